"""The peer benchmark's table: servelab against the Hugging Face peers, per concurrency.

``python run.py +experiment=peer_benchmark`` runs servelab's best configuration,
``hf_continuous`` and ``hf_static`` on one seeded burst workload, interleaved (per concurrency,
each repeat runs the three engines back to back), in one multirun; at its end this callback
prints (and writes ``peer_table.md/.csv``) one table: per engine the number of runs, the median
output tok/s with its range, median p50/p99 TTFT, and the ratios of servelab's medians to the
peer's (tok/s: higher is better for servelab; TTFT: lower is better for servelab). Medians of
interleaved repeats, because whole runs drift by up to ~25% on a shared machine.
``python -m experiments.peer_table <sweep dir>`` rebuilds it from the run folders.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig

from experiments.report import ReportCallback, collect, write_table_files

SERVELAB = "servelab"
METRICS = {"output_throughput": "output tok/s", "ttft_s_p50": "TTFT p50 (s)", "ttft_s_p99": "TTFT p99 (s)"}  # medians


def peer_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (concurrency, engine): runs, medians over repeats, servelab / engine ratios."""
    done = frame[frame["status"] == "ok"]
    rows: list[dict[str, Any]] = []
    for concurrency, group in done.groupby("concurrency", sort=True):
        by_engine = group.groupby("engine", sort=False)
        medians = by_engine[list(METRICS)].median()
        throughput = by_engine["output_throughput"]
        low, high, runs = throughput.min(), throughput.max(), by_engine.size()
        for engine in sorted(medians.index, key=lambda name: name != SERVELAB):  # stable: peers keep run order
            row = {"concurrency": concurrency, "engine": engine, "runs": int(runs[engine])}
            row.update({label: medians.at[engine, metric] for metric, label in METRICS.items()})
            row["tok/s range"] = f"{low[engine]:.1f}-{high[engine]:.1f}"
            if SERVELAB in medians.index and engine != SERVELAB:
                ours = medians.loc[SERVELAB]
                row["servelab / this tok/s"] = ours["output_throughput"] / medians.at[engine, "output_throughput"]
                row["servelab / this TTFT p50"] = ours["ttft_s_p50"] / medians.at[engine, "ttft_s_p50"]
            rows.append(row)
    failed = frame[frame["status"] != "ok"]
    for _, run in failed.iterrows():
        rows.append({"concurrency": run.get("concurrency"), "engine": run.get("engine"), "output tok/s": "failed"})
    return pd.DataFrame(rows)


def write_peer_table(root: Path) -> str:
    return write_table_files(peer_table(collect(root)), root, "peer_table")


class PeerTableCallback(ReportCallback):
    """Hydra callback: after the multirun, write the report and print the peer table."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        super().on_multirun_end(config, **kwargs)
        root = Path(config.hydra.sweep.dir)
        print(f"\npeer benchmark ({root}):\n{write_peer_table(root)}")


if __name__ == "__main__":
    print(write_peer_table(Path(sys.argv[1])))
