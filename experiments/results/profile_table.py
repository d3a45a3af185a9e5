"""One table over a load profile's runs: ``profile.md``, ``profile.csv``, ``profile.json``.

A profile (:mod:`experiments.harness.profiles`) leaves one numbered folder per run. This module
reads what the series recorded and writes, in the profile's folder:

* one row per run, in the order run: its folder, phase (synchronous / throughput / rate /
  concurrency / probe), the level it was given (target rate, ``all at once`` for an infinite
  one; client-side cap; arrival process), its status, what it achieved (request rate, output
  tok/s, goodput, the share of requests meeting every SLO), TTFT / ITL / E2E percentiles, the
  saturation verdict and, for max_goodput, the probe's verdict (meets / misses / failed);
* one row per level the series skipped (status ``skipped``), with the reason it stopped;
* the profile's parameters and result (the anchors' rates, the max-goodput rate and its
  bracket) in ``profile.json`` and at the top of ``profile.md``.

Files are written crash-safely and never overwrite an existing file (:mod:`experiments.results.files`).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.harness.load_levels import LoadLevel
from experiments.harness.profiles import LevelRun, Series
from experiments.results.files import write_csv, write_json
from experiments.results.safe_files import write_text_file

#: (column, metric key in summary.json) of each run's achieved numbers
METRIC_COLUMNS = [
    ("request_throughput", "request_throughput"), ("output_throughput", "output_throughput"),
    ("goodput", "goodput"),
    ("ttft_s_p50", "ttft_s_p50"), ("ttft_s_p90", "ttft_s_p90"), ("ttft_s_p99", "ttft_s_p99"),
    ("itl_s_p50", "itl_s_p50"), ("itl_s_p90", "itl_s_p90"), ("itl_s_p99", "itl_s_p99"),
    ("e2e_s_p50", "e2e_s_p50"), ("e2e_s_p90", "e2e_s_p90"), ("e2e_s_p99", "e2e_s_p99"),
    ("tpot_s_p50", "tpot_s_p50"), ("num_requests", "num_requests"),
]
COLUMNS = ["run", "phase", "target_rate", "concurrency_cap", "arrival", "status", "slo_share",
           *[name for name, _ in METRIC_COLUMNS], "saturated", "verdict", "note"]
#: (header, column) of the Markdown table: the columns a reader scans first
MARKDOWN_COLUMNS = [
    ("run", "run"), ("phase", "phase"), ("target req/s", "target_rate"), ("cap", "concurrency_cap"),
    ("status", "status"), ("req/s", "request_throughput"), ("output tok/s", "output_throughput"),
    ("goodput", "goodput"), ("SLO share", "slo_share"), ("TTFT p50 (s)", "ttft_s_p50"),
    ("TTFT p99 (s)", "ttft_s_p99"), ("ITL p50 (s)", "itl_s_p50"), ("ITL p99 (s)", "itl_s_p99"),
    ("E2E p50 (s)", "e2e_s_p50"), ("E2E p99 (s)", "e2e_s_p99"), ("saturated", "saturated"),
    ("verdict", "verdict"), ("note", "note"),
]


def _level_columns(level: LoadLevel) -> dict[str, Any]:
    infinite = level.rate is not None and math.isinf(level.rate)
    return {"phase": level.phase, "target_rate": "all at once" if infinite else level.rate,
            "concurrency_cap": level.concurrency, "arrival": None if infinite or level.rate is None else level.arrival}


def run_row(run: LevelRun) -> dict[str, Any]:
    """The table row of one run."""
    return {"run": run.folder.name, **_level_columns(run.level), "status": run.summary.get("status"),
            "slo_share": run.slo_share, **{name: run.metric(key) for name, key in METRIC_COLUMNS},
            "saturated": run.summary.get("saturated"), "verdict": run.verdict, "note": run.summary.get("error")}


def skipped_row(level: LoadLevel, reason: str | None) -> dict[str, Any]:
    """The table row of a level the series did not run."""
    return {"run": None, **_level_columns(level), "status": "skipped", "note": reason}


def profile_frame(series: Series) -> pd.DataFrame:
    rows = [run_row(run) for run in series.runs] + [skipped_row(level, series.stopped) for level in series.skipped]
    return pd.DataFrame(rows, columns=COLUMNS)


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _shown(value: Any) -> Any:
    """A parameter as a reader wants it: nested configs without their ``_target_`` keys."""
    if isinstance(value, dict):
        return {k: _shown(v) for k, v in value.items() if not k.startswith("_")}
    return value


def profile_markdown(name: str, params: dict[str, Any], series: Series, frame: pd.DataFrame) -> str:
    lines = [f"# servelab load profile: {name}", ""]
    lines += [f"Parameters: {', '.join(f'`{k}={_shown(v)}`' for k, v in params.items() if k != 'name' and not k.startswith('_'))}", ""]
    if series.result:
        lines += ["Result: " + ", ".join(f"`{k}` = {_cell(v)}" for k, v in series.result.items()), ""]
    if series.failed:
        lines += [f"**FAILED**: {series.stopped}", ""]
    elif series.stopped:
        lines += [f"**Stopped early**: {series.stopped}", ""]
    lines += ["| " + " | ".join(header for header, _ in MARKDOWN_COLUMNS) + " |",
              "| " + " | ".join("---" for _ in MARKDOWN_COLUMNS) + " |"]
    for row in frame.to_dict("records"):
        lines.append("| " + " | ".join(_cell(row[column]) for _, column in MARKDOWN_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def write_profile_table(name: str, params: dict[str, Any], series: Series, frame: pd.DataFrame) -> tuple[str, list[Path]]:
    """Write ``frame`` (:func:`profile_frame`) as profile.md / .csv / .json into the series folder;
    returns the Markdown and the files."""
    markdown = profile_markdown(name, params, series, frame)
    document = {"profile": name, "params": params, "result": series.result, "stopped": series.stopped,
                "failed": series.failed, "runs": frame.to_dict("records")}
    files = [write_text_file(markdown, series.out_dir / "profile.md"),
             write_csv(frame, series.out_dir / "profile.csv"),
             write_json(document, series.out_dir / "profile.json")]
    return markdown, files
