"""``report.html``: one self-contained page per run and per sweep, to open in any browser.

    python -m experiments.results.html_report results/runs/<time>        # a run folder
    python -m experiments.results.html_report results/sweeps/<time>      # a sweep folder
    python -m experiments.results.html_report <folder> --overwrite       # replace its report.html

It is written without asking, too: beside every run's files when the run ends
(:class:`RunPageCallback`, a Hydra callback in ``conf/config.yaml``; ``html_report=false`` turns it
off) and beside a sweep's ``report.md`` by :class:`experiments.results.report.ReportCallback`.
An existing ``report.html`` is never replaced silently: the new page is ``report_1.html`` (with a
warning) unless ``--overwrite`` is given.

What the page holds (built by :mod:`experiments.results.html_page`, plots from
:mod:`experiments.results.plots` and :mod:`experiments.results.load_curves`):

* a run: its headline numbers (the rows of ``summary.md``), its labels and SLOs, TTFT and ITL
  CDFs, KV usage over time, the resolved ``config.yaml`` and the environment from ``summary.json``;
* a sweep: the table of ``report.md`` (same columns, same numbers), the runs left out,
  latency-throughput curves (TTFT / ITL / E2E p50 and p99 vs achieved request/s), goodput vs
  request/s, the Pareto plot of output tok/s per user vs total output tok/s, every run's TTFT and
  ITL CDF and KV usage, the environment the runs share and where they differ, each run's config.

The ITL CDF is over requests' mean inter-token latency (``itl_mean_s`` of ``requests.csv``). A plot
without data (KV usage of an HTTP peer that reports none, curves of a one-run sweep) is replaced
by a sentence saying what is missing.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from experiments.results import html_page as h
from experiments.results.files import run_title, summary_rows
from experiments.results.load_curves import (
    LOAD_COLUMNS, REPEAT_COLUMNS, goodput_vs_rate_figure, latency_vs_rate_figure, pareto_figure,
)
from experiments.results.plots import cdf_figure, kv_over_time_figure
from experiments.results.report import (
    UNREADABLE, axis_columns, collect, format_value, headline_columns, job_tables, left_out_lines, read_summary,
    strategy_label,
)
from experiments.results.safe_files import write_text_file

log = logging.getLogger(__name__)
PAGE = "report.html"
NO_REQUESTS = "no run has a requests.csv with this column (the run failed, or wrote no per-request file)"
NO_KV = "no run recorded KV usage in steps.csv (an HTTP peer or remote server reports none)"


def _flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts as ``{"git.commit": "..."}``; lists and other values as text."""
    if isinstance(data, dict):
        flat: dict[str, str] = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): json.dumps(data) if isinstance(data, list) else format_value(data)}


def _pairs_table(pairs: dict[str, str] | Sequence[tuple[str, str]], header: tuple[str, str], table_id: str) -> str:
    rows = list(pairs.items()) if isinstance(pairs, dict) else list(pairs)
    return h.table(header, [list(row) for row in rows], table_id) if rows else h.paragraph("(none recorded)")


def _config_text(folder: Path) -> str:
    file = folder / "config.yaml"
    if not file.is_file():
        return "(no config.yaml in this folder)"
    try:
        return file.read_text()
    except OSError as error:
        return f"(config.yaml unreadable: {error})"


def _read_csv(file: Path, problems: list[str]) -> pd.DataFrame | None:
    if not file.is_file():
        return None
    try:
        return pd.read_csv(file)
    except UNREADABLE as error:
        problems.append(f"unreadable {file.name} ({type(error).__name__}: {error}); left out of the plots")
        return None


def _distribution_plots(requests: list[tuple[str, pd.DataFrame]], steps: list[tuple[str, pd.DataFrame]]) -> list[str]:
    """TTFT and ITL CDFs and KV usage over time, one curve per ``(label, table)``."""
    return [
        h.figure("TTFT CDF", cdf_figure(requests, "ttft_s", "TTFT (s)", "TTFT CDF"), NO_REQUESTS),
        h.figure("ITL CDF", cdf_figure(requests, "itl_mean_s", "mean inter-token latency of a request (s)", "ITL CDF"),
                 NO_REQUESTS, caption="Each request's mean gap between output tokens."),
        h.figure("KV usage over time", kv_over_time_figure(steps), NO_KV),
    ]


def run_page(run_dir: Path) -> str:
    """The page of one run folder (it has ``summary.json``)."""
    summary = read_summary(run_dir / "summary.json")
    problems: list[str] = []
    requests = _read_csv(run_dir / "requests.csv", problems)
    steps = _read_csv(run_dir / "steps.csv", problems)
    status = []
    if summary.get("status") != "ok":
        status.append(h.paragraph(f"FAILED: {summary.get('error')}", "failed"))
    if summary.get("simulation"):
        status.append(h.paragraph(f"Simulated: times are {summary['simulation'].get('timing')}."))
    sections = [
        h.section("Numbers", *status, h.table(["metric", "value"], [list(r) for r in summary_rows(summary)], "metrics")),
        h.section("Run", _pairs_table(_flatten(summary.get("run", {})), ("label", "value"), "run-labels"),
                  h.paragraph("Service-level objectives (goodput counts requests meeting all of them):"),
                  _pairs_table(_flatten(summary.get("slo") or {}), ("SLO", "bound"), "slo")),
        h.section("Plots", *_distribution_plots([("this run", requests)] if requests is not None else [],
                                                [("this run", steps)] if steps is not None else []),
                  h.bullet_list(problems) if problems else ""),
        h.section("Resolved config (config.yaml)", h.preformatted(_config_text(run_dir))),
        h.section("Environment (summary.json)", _pairs_table(_flatten(summary.get("environment", {})),
                                                             ("field", "value"), "environment")),
    ]
    return h.page(f"servelab run: {run_title(summary) or run_dir.name}", sections)


def _environments(root: Path, frame: pd.DataFrame) -> dict[str, dict[str, str]]:
    """Each readable run's flattened ``summary.json`` environment, by job."""
    found = {}
    for job in frame["job"]:
        try:
            found[str(job)] = _flatten(read_summary(root / job / "summary.json").get("environment", {}))
        except UNREADABLE:
            continue
    return found


def _environment_section(environments: dict[str, dict[str, str]]) -> str:
    keys = sorted({key for env in environments.values() for key in env})
    shared = {k: next(iter(environments.values()))[k] for k in keys
              if len({env.get(k) for env in environments.values()}) == 1}
    differing = [k for k in keys if k not in shared]
    parts = [h.paragraph(f"Shared by all {len(environments)} runs with a summary.json:"),
             _pairs_table(shared, ("field", "value"), "environment")]
    if differing:
        parts += [h.paragraph("Where the runs differ:"),
                  h.table(["job", *differing], [[job, *(env.get(k, "") for k in differing)]
                                                for job, env in environments.items()], "environment-differences")]
    return h.section("Environment (summary.json)", *parts)


def _strategy(axes: Sequence[str]) -> Callable[[pd.Series], str]:
    """A run's strategy: its values of the varying columns other than the load and the repeat number."""
    others = [c for c in axes if c not in LOAD_COLUMNS and c not in REPEAT_COLUMNS]
    return lambda row: strategy_label(row, others)


def sweep_page(root: Path) -> str:
    """The page of a sweep folder (one job folder per run below it)."""
    frame = collect(root)
    axes = axis_columns(frame)
    problems: list[str] = []
    requests = list(job_tables(root, frame, "requests.csv", axes, problems))
    steps = list(job_tables(root, frame, "steps.csv", axes, problems))
    columns = [c for c in headline_columns(frame, axes) if c in frame]
    rows = [[format_value(row[c]) for c in columns] for _, row in frame.iterrows()]
    broken = int((frame["status"] != "ok").sum())
    left_out = left_out_lines(frame, problems)
    strategy = _strategy(axes)
    one_run = "the sweep has fewer than two successful runs with these numbers"
    sections = [
        h.section("Runs (report.md)", h.paragraph(f"{len(frame)} runs, {broken} failed or unreadable."),
                  h.table([c.removeprefix("override:") for c in columns], rows, "runs")),
        h.section("Runs left out", h.bullet_list(left_out)) if left_out else "",
        h.section("Load curves",
                  h.figure("Latency vs achieved request rate", latency_vs_rate_figure(frame, strategy), one_run),
                  h.figure("Goodput vs achieved request rate", goodput_vs_rate_figure(frame, strategy), one_run),
                  h.figure("Pareto: output tok/s per user vs total output tok/s", pareto_figure(frame, strategy), one_run,
                           caption="Per user: 1 / mean TPOT. The line joins the runs no other run beats on both axes.")),
        h.section("Distributions", *_distribution_plots(requests, steps)),
        _environment_section(_environments(root, frame)),
        h.section("Resolved configs (config.yaml of each run)",
                  *[h.details(f"job {job}", h.preformatted(_config_text(root / job))) for job in frame["job"]]),
    ]
    return h.page(f"servelab sweep: {root.name}", sections)


def write_html_report(folder: Path, replace: bool = False) -> Path:
    """``report.html`` in ``folder`` (a run folder with ``summary.json``, or a sweep folder); returns its
    path (``report_1.html``... when the name is taken, unless ``replace``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder (expected a run folder with summary.json or a sweep folder)")
    try:
        text = run_page(folder) if (folder / "summary.json").is_file() else sweep_page(folder)
    except FileNotFoundError as error:
        raise ValueError(f"{folder}: {error}") from None
    return write_text_file(text, folder / PAGE, replace=replace)


class RunPageCallback(Callback):
    """Hydra callback: ``report.html`` beside a run's files when its job ends (every job of a multirun too;
    for a load profile, one page over its series' level folders).
    A page that cannot be written is logged, never fails the run."""

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if not config.get("html_report", True):
            return
        out_dir = Path(config.hydra.runtime.output_dir)
        # a single run has summary.json; a load profile's series has one per level folder below it
        if not (out_dir / "summary.json").is_file() and not any(out_dir.glob("*/summary.json")):
            log.warning("no report.html for %s: the run wrote no summary.json", out_dir)
            return
        try:
            log.info("report: %s", write_html_report(out_dir))
        except Exception:  # noqa: BLE001 -- the run's results are written; the page is an extra
            log.exception("report.html for %s could not be written", out_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a run folder (with summary.json) or a sweep folder")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing report.html (default: report_1.html)")
    args = parser.parse_args(argv)
    try:
        print(write_html_report(args.folder, replace=args.overwrite))
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
