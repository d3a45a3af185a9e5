"""The peer benchmark's table: servelab's server over HTTP against its peers, per concurrency.

``python run.py +experiment=peer_benchmark`` runs, on one seeded burst workload per concurrency,
each ``+serving`` preset of the sweep (servelab's server over HTTP, servelab in-process, llama.cpp
F32 and Q4_1, HF ``generate_batch`` and HF static), interleaved (each repeat runs every engine
back to back), in one multirun. At its end this callback prints (and writes
``peer_table.md/.csv``) one table: per concurrency and engine (the ``+serving`` preset's name)
the number of runs, the median output tok/s with its range, median TTFT p50/p99 and TPOT p50,
and the ratios of the reference engine's medians (:data:`REFERENCE`, servelab over HTTP) to
this engine's (tok/s: above 1 = servelab ahead; TTFT: below 1 = servelab ahead). servelab
in-process is one more row beside it: what the HTTP layer costs. Medians of interleaved
repeats, because whole runs drift by up to ~25% on a shared machine.

Runs that failed are not dropped: an engine none of whose runs succeeded gets a row saying
``not run`` with the first line of the error (e.g. llama.cpp without a compiler to build it); one
with some failed runs says how many in ``failed``. With ``targets`` (ratios to reach, from the experiment's YAML),
``peer_targets.md/.csv`` marks each one met or not with the measured ratio.
``python -m experiments.peers.table <sweep dir>`` rebuilds the table from the run folders.

With ``+peer_shape`` swept (conf/peer_shape/: the workload shapes the field quotes, e.g. random
128/64 greedy and sampled, random 1024/128, chat), rows are grouped per shape first (a ``shape``
column), and each shape also gets its own table ``peer_table_<shape>.md/.csv`` and plot
``peer_<shape>.png`` (output tok/s and TTFT p50 against concurrency, one line per engine); a
target with a ``shape`` applies to that shape's rows only.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, ListConfig, OmegaConf

from experiments.results.plots import plot_vs
from experiments.results.report import ReportCallback, collect, write_table_files

REFERENCE = "servelab_http"
SHAPE = "override:peer_shape"   # the +peer_shape option of a run (conf/peer_shape/), when swept
METRICS = {"output_throughput": "output tok/s", "ttft_s_p50": "TTFT p50 (s)", "ttft_s_p99": "TTFT p99 (s)",
           "tpot_s_p50": "TPOT p50 (s)"}  # medians over repeats
RATIOS = {f"{REFERENCE} / this tok/s": "output_throughput", f"{REFERENCE} / this TTFT p50": "ttft_s_p50"}


def engine_names(frame: pd.DataFrame) -> pd.Series:
    """Each run's name in the table: its ``+serving`` preset, else its engine."""
    engine = frame["engine"] if "engine" in frame else pd.Series("run", index=frame.index)
    if "override:serving" not in frame:
        return engine
    return frame["override:serving"].where(frame["override:serving"].notna(), engine)


def first_line(error: Any) -> str:
    return str(error).strip().splitlines()[0] if isinstance(error, str) and error.strip() else "no error recorded"


def peer_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per ([shape,] concurrency, engine), the reference first, then in run order (see the
    module docstring); shapes in run order."""
    if SHAPE in frame and frame[SHAPE].notna().any():
        shapes = list(dict.fromkeys(frame[SHAPE].dropna()))
        parts = [shape_rows(frame[frame[SHAPE] == shape]).assign(shape=shape) for shape in shapes]
        table = pd.concat(parts, ignore_index=True)
        return table[["shape", *[c for c in table.columns if c != "shape"]]]
    return shape_rows(frame)


def shape_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of one shape: per concurrency, one per engine."""
    frame = frame.assign(peer=engine_names(frame))
    order = list(dict.fromkeys(frame["peer"]))
    rows: list[dict[str, Any]] = []
    for concurrency, group in frame.groupby("concurrency", sort=True):
        done = group[group["status"] == "ok"]
        medians = done.groupby("peer")[list(METRICS)].median()
        for peer in sorted(dict.fromkeys(group["peer"]), key=lambda name: (name != REFERENCE, order.index(name))):
            runs = group[group["peer"] == peer]
            ok = runs[runs["status"] == "ok"]
            failed = runs[runs["status"] != "ok"]
            row: dict[str, Any] = {"concurrency": concurrency, "engine": peer, "runs": len(ok)}
            if ok.empty:
                row["failed"] = f"not run: {first_line(failed['error'].iloc[0] if 'error' in failed else None)}"
                rows.append(row)
                continue
            row.update({label: medians.at[peer, metric] for metric, label in METRICS.items()})
            row["tok/s range"] = f"{ok['output_throughput'].min():.1f}-{ok['output_throughput'].max():.1f}"
            if REFERENCE in medians.index and peer != REFERENCE:
                for label, metric in RATIOS.items():
                    row[label] = medians.at[REFERENCE, metric] / medians.at[peer, metric]
            if not failed.empty:
                row["failed"] = f"{len(failed)} of {len(runs)}: {first_line(failed['error'].iloc[0] if 'error' in failed else None)}"
            rows.append(row)
    return pd.DataFrame(rows)


def target_checks(table: pd.DataFrame, targets: list[dict[str, Any]]) -> pd.DataFrame:
    """Each target (``concurrency``, ``peer``, ``ratio``: a ratio column's name, ``at_least`` or
    ``at_most``) with the measured ratio and whether it is met (``not measured`` without one)."""
    rows = []
    for target in targets:
        match = table[(table["concurrency"] == target["concurrency"]) & (table["engine"] == target["peer"])]
        if "shape" in target:
            match = match[match["shape"] == target["shape"]] if "shape" in match else match.iloc[0:0]
        measured = match[target["ratio"]].iloc[0] if not match.empty and target["ratio"] in match else None
        bound = f">= {target['at_least']}" if "at_least" in target else f"<= {target['at_most']}"
        if measured is None or pd.isna(measured):
            met = "not measured"
        else:
            met = "met" if (measured >= target["at_least"] if "at_least" in target else measured <= target["at_most"]) else "NOT met"
        rows.append({**({"shape": target["shape"]} if "shape" in target else {}),
                     "concurrency": target["concurrency"], "peer": target["peer"], "ratio": target["ratio"],
                     "target": bound, "measured": measured, "result": met})
    return pd.DataFrame(rows)


def write_peer_table(root: Path, targets: list[dict[str, Any]] | None = None) -> str:
    table = peer_table(collect(root))
    text = write_table_files(table, root, "peer_table")
    for shape, rows in (table.groupby("shape", sort=False) if "shape" in table else ()):
        rows = rows.drop(columns="shape")
        write_table_files(rows, root, f"peer_table_{shape}")
        ran = rows.assign(status=(rows["runs"] > 0).map({True: "ok", False: "not run"}))
        plot_vs(ran, "concurrency", [("output tok/s", "output tok/s"), ("TTFT p50 (s)", "TTFT p50 (s)")],
                root / f"peer_{shape}.png", label=lambda row: row["engine"])
    if targets:
        text += "\n\ntargets:\n" + write_table_files(target_checks(table, targets), root, "peer_targets")
    return text


class PeerTableCallback(ReportCallback):
    """Hydra callback: after the multirun, write the report and print the peer table (and the targets)."""

    def __init__(self, targets: Any = None) -> None:
        self.targets = OmegaConf.to_container(targets, resolve=True) if isinstance(targets, ListConfig) else targets

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        super().on_multirun_end(config, **kwargs)
        root = Path(config.hydra.sweep.dir)
        print(f"\npeer benchmark ({root}):\n{write_peer_table(root, self.targets)}")


def sweep_targets(root: Path) -> list[dict[str, Any]] | None:
    """The targets the sweep ran with (``multirun.yaml``'s peer_table callback), if any."""
    file = root / "multirun.yaml"
    if not file.is_file():
        return None
    targets = OmegaConf.select(OmegaConf.load(file), "hydra.callbacks.peer_table.targets")
    return OmegaConf.to_container(targets, resolve=True) if targets is not None else None


if __name__ == "__main__":
    print(write_peer_table(Path(sys.argv[1]), sweep_targets(Path(sys.argv[1]))))
