"""What the HTTP layer costs: the same configuration in-process and over HTTP, side by side.

A sweep that runs ``engine=servelab`` (the in-process driver) and ``engine=servelab_http`` (the
same strategy behind ``serve.py``, measured by the HTTP load client) over otherwise identical
configurations gets one row per configuration: median output tok/s and TTFT p50/p99 of each
(medians over interleaved repeats, ``+repeat=...``), and HTTP / in-process ratios (tok/s: 1.0
means the server costs nothing; TTFT: 1.0 means no added latency). Written as
``http_vs_inprocess.md/.csv`` at the end of the sweep (Hydra callback), or rebuilt with
``python -m experiments.bench.http_overhead <sweep dir>``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig

from experiments.results.report import ReportCallback, axis_columns, collect, write_table_files

IN_PROCESS, OVER_HTTP = "servelab", "servelab_http"
METRICS = {"output_throughput": "tok/s", "ttft_s_p50": "TTFT p50 (s)", "ttft_s_p99": "TTFT p99 (s)"}


def overhead_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration (every varying axis but the engine and the repeat label)."""
    done = frame[(frame["status"] == "ok") & frame["engine"].isin([IN_PROCESS, OVER_HTTP])]
    keys = [c for c in axis_columns(frame) if c not in ("engine", "override:engine", "override:repeat")]
    rows: list[dict[str, Any]] = []
    for key, group in (done.groupby(keys, sort=True, dropna=False) if keys else [((), done)]):
        row: dict[str, Any] = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        by_engine = group.groupby("engine")
        medians, runs = by_engine[list(METRICS)].median(), by_engine.size()
        low, high = by_engine["output_throughput"].min(), by_engine["output_throughput"].max()
        for engine, tag in ((IN_PROCESS, "in-process"), (OVER_HTTP, "HTTP")):
            row[f"{tag} runs"] = int(runs.get(engine, 0))
            for metric, label in METRICS.items():
                row[f"{tag} {label}"] = medians.at[engine, metric] if engine in medians.index else None
            row[f"{tag} tok/s range"] = f"{low[engine]:.1f}-{high[engine]:.1f}" if engine in medians.index else None
        if {IN_PROCESS, OVER_HTTP} <= set(medians.index):
            row["HTTP / in-process tok/s"] = medians.at[OVER_HTTP, "output_throughput"] / medians.at[IN_PROCESS, "output_throughput"]
            row["HTTP / in-process TTFT p50"] = medians.at[OVER_HTTP, "ttft_s_p50"] / medians.at[IN_PROCESS, "ttft_s_p50"]
        rows.append(row)
    return pd.DataFrame(rows)


def write_overhead_table(root: Path) -> str:
    return write_table_files(overhead_table(collect(root)), root, "http_vs_inprocess")


class HTTPOverheadCallback(ReportCallback):
    """Hydra callback: the in-process vs HTTP table in the sweep folder when the multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print(write_overhead_table(Path(config.hydra.sweep.dir)))


if __name__ == "__main__":
    print(write_overhead_table(Path(sys.argv[1])))
