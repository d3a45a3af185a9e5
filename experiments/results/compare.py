"""Two runs or two sweeps side by side, with the ratio B/A of every headline metric.

    python -m experiments.compare A B                  # A, B: run folders or sweep folders
    python -m experiments.compare A B --out DIR        # where compare.md / compare.csv go

What a user does after swapping one strategy: run the same command twice (``cache=paged`` then
``cache=prefix``), then compare. Each side is a run folder (it has ``summary.json``) or a sweep
folder (job folders below it, as :mod:`experiments.results.report` reads them).

Runs are matched by their *run label*: their values of the overrides that vary within either
sweep (``workload.concurrency=8``, ``scheduler=static``), so a c = 1 / 8 / 32 sweep under one cache
pairs c = 8 with c = 8 under the other. Two single runs (or one-run sweeps) always pair. Runs only
one side has are listed, not compared; two sweeps with no label in common are an error.

Per pair and metric: A, B, ``B/A`` and which side is better (higher output tok/s, request/s,
goodput and prefix hits; lower latencies). Metrics missing on both sides (prefix hits of an HTTP
peer) are left out. The table is printed and written as ``compare.md`` and ``compare.csv`` into
``--out`` (default ``results/compare/<time>/``, never inside A or B); existing files are never
replaced (``compare_1.md``...).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.results.files import write_csv
from experiments.results.report import job_dirs, job_row, markdown_table
from experiments.results.safe_files import write_text_file

#: (label, summary.json metric, True when higher is better)
METRICS = [
    ("output tok/s", "output_throughput", True), ("request/s", "request_throughput", True),
    ("TTFT p50 (s)", "ttft_s_p50", False), ("TTFT p99 (s)", "ttft_s_p99", False),
    ("TPOT p50 (s)", "tpot_s_p50", False), ("TPOT p99 (s)", "tpot_s_p99", False),
    ("ITL p50 (s)", "itl_s_p50", False), ("ITL p99 (s)", "itl_s_p99", False),
    ("E2E p50 (s)", "e2e_s_p50", False), ("E2E p99 (s)", "e2e_s_p99", False),
    ("goodput (req/s)", "goodput", True),
    ("prefix hit tokens", "prefix_hit_tokens", True), ("prefix hit rate", "prefix_hit_rate", True),
]
COLUMNS = ["run", "metric", "A", "B", "B/A", "better"]


@dataclass
class Side:
    """One side of a comparison: its folder and one report row per run (job folder -> row)."""

    folder: Path
    rows: dict[str, dict[str, Any]]

    def overrides(self, job: str) -> dict[str, str]:
        return {k.removeprefix("override:"): str(v) for k, v in self.rows[job].items() if k.startswith("override:")}

    def varying_overrides(self) -> set[str]:
        keys = {k for job in self.rows for k in self.overrides(job)}
        return {k for k in keys if len({self.overrides(job).get(k) for job in self.rows}) > 1}


def load_side(folder: Path) -> Side:
    """The runs of a run folder or a sweep folder; ``ValueError`` naming the folder when it holds none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder (expected a run folder with summary.json or a sweep folder)")
    jobs = [folder] if (folder / "summary.json").is_file() else [j for j in job_dirs(folder) if (j / "summary.json").is_file()]
    if not jobs:
        raise ValueError(f"{folder}: no summary.json in it or in any folder below it: not a servelab run or sweep "
                         f"folder (or every run died before writing its summary)")
    rows = {}
    for job in jobs:
        row = job_row(folder, job)
        rows[row["job"]] = row
    return Side(folder, rows)


def run_labels(side: Side, keys: Sequence[str]) -> dict[str, str]:
    """``{label: job}``: each run's values of ``keys`` (``-`` where it has no such override);
    ``ValueError`` when two runs of the side share a label."""
    labels: dict[str, str] = {}
    for job in side.rows:
        overrides = side.overrides(job)
        label = " ".join(f"{k}={overrides.get(k, '-')}" for k in keys) or "run"
        if label in labels:
            raise ValueError(f"{side.folder}: jobs {labels[label]} and {job} have the same run label ({label}); "
                             "compare sweeps whose runs differ in their overrides")
        labels[label] = job
    return labels


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def metric_rows(label: str, a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """The comparison rows of one pair of runs: status when either is not ok, then each metric either has."""
    rows = []
    if a.get("status") != "ok" or b.get("status") != "ok":
        rows.append({"run": label, "metric": "status", "A": a.get("status"), "B": b.get("status")})
    for name, key, higher_is_better in METRICS:
        x, y = _number(a.get(key)), _number(b.get(key))
        if x is None and y is None:
            continue
        ratio = y / x if x is not None and y is not None and x != 0 else None
        better = "" if ratio is None else "same" if ratio == 1 else "B" if (ratio > 1) == higher_is_better else "A"
        rows.append({"run": label, "metric": name, "A": x, "B": y, "B/A": ratio, "better": better})
    return rows


@dataclass
class Comparison:
    table: pd.DataFrame
    only_a: list[str]
    only_b: list[str]
    keys: list[str]


def compare(a: Side, b: Side) -> Comparison:
    """Pair the runs of ``a`` and ``b`` by run label and tabulate every metric of every pair (a side with
    one run varies nothing, so two single runs both have the empty label and pair)."""
    keys = sorted(a.varying_overrides() | b.varying_overrides())
    labels_a, labels_b = run_labels(a, keys), run_labels(b, keys)
    common = [label for label in labels_a if label in labels_b]
    if not common:
        raise ValueError(f"no run in common between {a.folder} and {b.folder}: runs are matched by the overrides that "
                         f"vary in either sweep ({', '.join(keys)}); {a.folder} has {sorted(labels_a)}, "
                         f"{b.folder} has {sorted(labels_b)}")
    rows = [row for label in common for row in metric_rows(label, a.rows[labels_a[label]], b.rows[labels_b[label]])]
    return Comparison(table=pd.DataFrame(rows, columns=COLUMNS), keys=keys,
                      only_a=[label for label in labels_a if label not in labels_b],
                      only_b=[label for label in labels_b if label not in labels_a])


def comparison_markdown(result: Comparison, a: Path, b: Path) -> str:
    lines = ["# servelab comparison", "", f"- A: `{a}`", f"- B: `{b}`",
             f"- runs matched by: {', '.join(result.keys) or 'one run on each side'}", "",
             markdown_table(result.table, COLUMNS), ""]
    for name, only in (("A", result.only_a), ("B", result.only_b)):
        if only:
            lines += [f"Only in {name} (not compared): {'; '.join(only)}", ""]
    return "\n".join(lines)


def write_comparison(a: Path, b: Path, out: Path) -> tuple[str, list[Path]]:
    """Compare ``a`` with ``b``; write compare.md and compare.csv into ``out``; returns the markdown and the files."""
    result = compare(load_side(a), load_side(b))
    text = comparison_markdown(result, a, b)
    return text, [write_text_file(text, out / "compare.md"), write_csv(result.table, out / "compare.csv")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.compare", description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="run folder or sweep folder A (the baseline)")
    parser.add_argument("b", type=Path, help="run folder or sweep folder B (ratios are B/A)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for compare.md and compare.csv (default: results/compare/<time>/)")
    args = parser.parse_args(argv)
    out = args.out or Path("results/compare") / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    try:
        text, written = write_comparison(args.a, args.b, out)
    except ValueError as error:
        parser.error(str(error))
    print(text)
    print("\n".join(f"written: {path}" for path in written))
    return 0
