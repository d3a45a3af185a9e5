"""Aggregate a multirun into one table and comparison plots.

    python -m experiments.results.report results/sweeps/<dir>

Every job folder under the sweep (one with ``summary.json`` or a ``.hydra`` folder) becomes one
row of ``report.csv`` / ``report.md``: its status, its swept overrides as columns, the run labels
(engine, cache, scheduler, attention, concurrency, block_size...) and every summary metric. A job
that crashed before writing ``summary.json`` is listed as failed; one whose files cannot be read
(truncated by a crash of an older version, damaged) is listed as ``unreadable`` with the reason,
and the report goes on. Plots (when their axis varies; drawn by :mod:`experiments.results.plots`):
output tok/s and TTFT p50/p99 vs concurrency per strategy, TTFT CDF, KV usage over time,
block-size sweep. Then ``report.html`` (:mod:`experiments.results.html_report`): the same table
and more plots in one self-contained page.
"""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from experiments.harness.metrics import decode_seconds_per_1k_context
from experiments.results.files import write_csv, write_text_file
from experiments.results.plots import plot_kv_over_time, plot_ttft_cdf, plot_vs

LABEL_COLUMNS = ["engine", "hardware", "model", "cache", "scheduler", "attention", "attention_backend", "workload", "concurrency", "block_size",
                 "capacity_tokens", "max_num_seqs", "dtype", "seed"]
REPORT_FILES = ["report.csv", "report.md", "throughput_vs_concurrency.png", "ttft_vs_concurrency.png",
                "block_size_sweep.png", "ttft_cdf.png", "kv_usage.png", "report.html"]
MARKDOWN_METRICS = ["output_throughput", "request_throughput", "ttft_s_p50", "ttft_s_p99", "tpot_s_mean",
                    "e2e_s_p50", "client_queue_s_p50", "goodput", "wasted_slots", "forward_passes", "preemptions", "max_queued_steps", "prefix_hit_tokens", "prefix_hit_rate",
                    "mean_kv_used_reserved_ratio", "decode_step_s_p50", "decode_kv_tokens_p50",
                    "swap_out_bytes", "swap_time_s"]
SHOWN_WHEN_NONZERO = {"swap_out_bytes", "swap_time_s"}  # swap columns only in sweeps where something swapped


def job_dirs(root: Path) -> list[Path]:
    """Folders holding one job each: they have a summary.json or a .hydra folder."""
    found = {p.parent for p in root.rglob("summary.json")} | {p.parent for p in root.rglob(".hydra")}
    return sorted(found, key=lambda p: [int(part) if part.isdigit() else part for part in p.relative_to(root).parts])


def parse_overrides(job: Path) -> dict[str, str]:
    """``.hydra/overrides.yaml`` as ``{key: value}`` (``+``/``~``/``++`` prefixes dropped)."""
    file = job / ".hydra" / "overrides.yaml"
    if not file.is_file():
        return {}
    pairs = {}
    for item in yaml.safe_load(file.read_text()) or []:
        key, _, value = str(item).partition("=")
        pairs[key.lstrip("+~")] = value
    return pairs


#: what reading a damaged file raises (JSON, CSV and YAML parse errors are ValueErrors or YAMLError)
UNREADABLE = (OSError, ValueError, yaml.YAMLError)


def read_summary(file: Path) -> dict[str, Any]:
    summary = json.loads(file.read_text())
    if not isinstance(summary, dict):
        raise ValueError(f"expected a JSON object, got {type(summary).__name__}")
    return summary


def job_row(root: Path, job: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"job": str(job.relative_to(root)) or "."}
    try:
        overrides = parse_overrides(job)
    except UNREADABLE as error:
        overrides = {}
        row["error"] = f"unreadable .hydra/overrides.yaml ({type(error).__name__}: {error})"
    summary_file = job / "summary.json"
    if not summary_file.is_file():
        row.update(status="failed", error="no summary.json: the job died before writing it")
    else:
        try:
            summary = read_summary(summary_file)
        except UNREADABLE as error:
            row.update(status="unreadable", error=f"unreadable summary.json ({type(error).__name__}: {error})")
        else:
            row.update(status=summary.get("status"), error=summary.get("error"))
            row.update({k: v for k, v in summary.get("run", {}).items() if k != "overrides"})
            row.update(summary.get("metrics", {}))
    row.update({f"override:{k}": v for k, v in overrides.items()})
    return row


def collect(root: Path) -> pd.DataFrame:
    rows = [job_row(root, job) for job in job_dirs(root)]
    if not rows:
        raise FileNotFoundError(f"no job folders (summary.json or .hydra/) under {root}")
    return pd.DataFrame(rows)


def varying(frame: pd.DataFrame, candidates: Sequence[str]) -> list[str]:
    """Candidate columns that take more than one value across runs."""
    return [c for c in candidates if c in frame and frame[c].astype(str).nunique() > 1]


def axis_columns(frame: pd.DataFrame) -> list[str]:
    """Columns that distinguish runs: varying labels, then varying overrides not already covered."""
    labels = varying(frame, LABEL_COLUMNS)
    overrides = [c for c in frame.columns if c.startswith("override:")]
    covered = {f"override:{c}" for c in labels} | {"override:workload.concurrency", "override:workload.num_users",
                                                     "override:cache.block_size"}  # shown as concurrency / block_size
    return labels + [c for c in varying(frame, overrides) if c not in covered]


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def strategy_label(row: pd.Series, columns: Sequence[str]) -> str:
    """``engine=servelab / scheduler=static``: the row's values of ``columns``, skipping empty ones
    and overrides that only repeat a label (``+serving=static`` next to ``scheduler=static``)."""
    parts, seen = [], set()
    for column in columns:
        value = row[column]
        if _missing(value) or (column.startswith("override:") and str(value) in seen):
            continue
        seen.add(str(value))
        parts.append(f"{column.removeprefix('override:')}={value}")
    return " / ".join(parts) or "run"


def format_value(value: Any) -> str:
    """A report cell: empty when missing, four significant digits for floats (report.md and report.html)."""
    if _missing(value):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _fmt(value: Any) -> str:
    return format_value(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pd.DataFrame, columns: Sequence[str]) -> str:
    columns = [c for c in columns if c in frame]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row[c]) for c in columns) + " |" for _, row in frame.iterrows()]
    return "\n".join(lines)


def write_table_files(table: pd.DataFrame, root: Path, stem: str) -> str:
    """``<stem>.csv`` and ``<stem>.md`` of ``table`` in ``root`` (crash-safe, never overwritten); returns the markdown."""
    write_csv(table, root / f"{stem}.csv")
    text = markdown_table(table, list(table.columns))
    write_text_file(text + "\n", root / f"{stem}.md")
    return text


def job_tables(root: Path, frame: pd.DataFrame, name: str, groups: Sequence[str],
               problems: list[str]) -> Iterator[tuple[str, pd.DataFrame]]:
    """``(label, table)`` for every successful job that wrote the CSV file ``name``, labelled by its
    job folder and its values of ``groups``; a file that cannot be read is skipped and named in ``problems``."""
    for _, row in frame[frame["status"] == "ok"].iterrows():
        file = root / row["job"] / name
        if not file.is_file():
            continue
        try:
            table = pd.read_csv(file)
        except UNREADABLE as error:
            problems.append(f"job {row['job']}: unreadable {name} ({type(error).__name__}: {error}); left out of the plots")
            continue
        yield f"{row['job']}: {strategy_label(row, groups)}", table


def decode_scaling_lines(frame: pd.DataFrame) -> list[str]:
    """When runs differ in context size: the decode-step cost per 1,000 context tokens, fitted
    over each run's median decode step (nano-vLLM's measure)."""
    if not {"decode_kv_tokens_p50", "decode_step_s_p50"} <= set(frame.columns):
        return []
    runs = frame[(frame["status"] == "ok")].dropna(subset=["decode_kv_tokens_p50", "decode_step_s_p50"])
    if "context_len" not in " ".join(axis_columns(frame)):
        return []
    slope = decode_seconds_per_1k_context(list(zip(runs["decode_kv_tokens_p50"], runs["decode_step_s_p50"])))
    if slope is None:
        return []
    return [f"Decode step cost: {slope * 1000:.1f} ms per 1,000 context tokens summed over the batch (least-squares "
            f"over {len(runs)} runs' median decode-only step vs their KV tokens in use, all sequences together).", ""]


def headline_columns(frame: pd.DataFrame, axes: Sequence[str]) -> list[str]:
    """report.md's columns: the job, its status, the ``axes`` that tell runs apart, every headline metric
    some run has (swap columns only where something swapped, per-priority TTFTs where classes ran), the error."""
    per_class = [c for c in frame.columns if c.startswith("priority_") and ("ttft_s" in c)]
    reported = [m for m in [*MARKDOWN_METRICS, *per_class] if m in frame and frame[m].notna().any()
                and (m not in SHOWN_WHEN_NONZERO or (frame[m].fillna(0) != 0).any())]
    return ["job", "status", *axes, *reported, "error"]


def left_out_lines(frame: pd.DataFrame, problems: Sequence[str]) -> list[str]:
    """One line per run that failed or could not be read, then each file left out of the plots."""
    broken = frame[frame["status"] != "ok"]
    return [*[f"job {row['job']}: {row['status']}: {row['error']}" for _, row in broken.iterrows()], *problems]


def write_report(root: Path) -> list[Path]:
    """report.csv, report.md and the plots; returns their paths (csv, md, then plots)."""
    frame = collect(root)
    axes = axis_columns(frame)
    problems: list[str] = []

    def label_without(x: str) -> Callable[[pd.Series], str]:
        """A run's strategy label over the varying columns other than the plot's axis ``x``."""
        others = [c for c in axes if c not in (x, f"override:{x}")]
        return lambda row: strategy_label(row, others)

    plots = [
        plot_vs(frame, "concurrency", [("output_throughput", "output tok/s")], root / "throughput_vs_concurrency.png",
                label_without("concurrency")),
        plot_vs(frame, "concurrency", [("ttft_s_p50", "TTFT p50 (s)"), ("ttft_s_p99", "TTFT p99 (s)")],
                root / "ttft_vs_concurrency.png", label_without("concurrency")),
        plot_vs(frame, "block_size", [("output_throughput", "output tok/s"),
                                      ("mean_kv_used_reserved_ratio", "mean KV used / reserved")],
                root / "block_size_sweep.png", label_without("block_size")),
        plot_ttft_cdf(job_tables(root, frame, "requests.csv", axes, problems), root / "ttft_cdf.png"),
        plot_kv_over_time(job_tables(root, frame, "steps.csv", axes, problems), root / "kv_usage.png"),
    ]
    broken = frame[frame["status"] != "ok"]
    md = [f"# servelab report: {root}", "", f"{len(frame)} runs, {len(broken)} failed or unreadable.", "",
          markdown_table(frame, headline_columns(frame, axes)), "", *decode_scaling_lines(frame)]
    left_out = left_out_lines(frame, problems)
    if left_out:
        md += ["## Runs left out", "", *[f"- {line}" for line in left_out], ""]
    written = [write_csv(frame, root / "report.csv"), write_text_file("\n".join(md), root / "report.md")]
    return written + [p for p in plots if p is not None]


def write_report_and_page(root: Path, page: bool = True) -> list[Path]:
    """:func:`write_report`, then (``page``) the sweep's report.html after them."""
    from experiments.results.html_report import write_html_report  # the page module imports this one

    written = write_report(root)
    return written + ([write_html_report(root)] if page else [])


class ReportCallback(Callback):
    """Hydra callback: write the report (and report.html unless ``html_report=false``) into the sweep
    folder when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        written = write_report_and_page(Path(config.hydra.sweep.dir), page=config.get("html_report", True))
        print(written[1].read_text())
        print("\n".join(str(p) for p in written))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun folder (results/sweeps/<time>) or a single run folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace report files from an earlier report run (default: write report_1.csv ...)")
    args = parser.parse_args(argv)
    if args.overwrite:
        for name in REPORT_FILES:
            (args.sweep_dir / name).unlink(missing_ok=True)
    written = write_report_and_page(args.sweep_dir)
    print(written[1].read_text())
    print("\n".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
