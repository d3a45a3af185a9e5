"""Write one run's result files (requests.csv, steps.csv, summary.json, summary.md).

Column lists live here and are documented in docs/results_columns.md. Every file is written
crash-safely through :mod:`experiments.results.safe_files` (a temporary name, then an atomic link) and
never overwritten silently: if a name is taken, a warning is logged and ``name_1.ext``,
``name_2.ext``... is written instead.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.harness.metrics import (
    SLO, e2e, e2e_including_client_queue, itls, meets_slo, queue_time, tpot, ttft,
)
from experiments.harness.records import RequestRecord
from experiments.results.safe_files import write_file, write_text_file
from simulator.extrapolation import extrapolation_markdown

log = logging.getLogger(__name__)

REQUEST_COLUMNS = [
    "request_id", "engine_request_id", "prompt_tokens", "output_tokens",
    "arrival_s", "submit_s", "first_scheduled_s", "first_token_s", "finish_s",
    "queue_s", "ttft_s", "e2e_s", "tpot_s", "itl_mean_s", "itl_max_s",
    "client_queue_s", "e2e_including_client_queue_s",
    "num_cached_tokens", "num_preemptions", "finish_reason", "meets_slo", "output_token_ids",
    "prompt_text", "output_text", "priority",
]
STEP_COLUMNS = [
    "step", "start_time", "end_time", "duration_s", "num_seqs", "num_prefill_tokens", "num_decode_tokens",
    "num_wasted_slots", "kv_used_tokens", "kv_reserved_tokens", "kv_capacity_tokens", "num_preempted",
    "prefix_hit_tokens", "num_waiting", "num_running", "forward_passes",
    "swap_out_blocks", "swap_in_blocks", "swap_out_bytes", "swap_in_bytes", "swap_time_s",
    "num_sampled", "context_tokens", "prefill_attention_pairs", "padded_attention_pairs", "shared_context_tokens",
]


def requests_frame(records: Sequence[RequestRecord], slo: SLO) -> pd.DataFrame:
    rows = []
    for r in records:
        gaps = itls(r)
        rows.append({
            "request_id": r.request_id, "engine_request_id": r.engine_request_id,
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
            "arrival_s": r.arrival_s, "submit_s": r.submit_s, "first_scheduled_s": r.first_scheduled_s,
            "first_token_s": r.first_token_s, "finish_s": r.finish_s,
            "queue_s": queue_time(r), "ttft_s": ttft(r), "e2e_s": e2e(r), "tpot_s": tpot(r),
            "itl_mean_s": sum(gaps) / len(gaps) if gaps else None, "itl_max_s": max(gaps) if gaps else None,
            "client_queue_s": r.client_queue_s, "e2e_including_client_queue_s": e2e_including_client_queue(r),
            "num_cached_tokens": r.num_cached_tokens, "num_preemptions": r.num_preemptions,
            "finish_reason": r.finish_reason, "meets_slo": meets_slo(r, slo),
            "output_token_ids": " ".join(map(str, r.output_token_ids)),
            "prompt_text": r.prompt_text, "output_text": r.output_text, "priority": r.priority,
        })
    return pd.DataFrame(rows, columns=REQUEST_COLUMNS)


def steps_frame(steps: Sequence[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame([{c: s.get(c) for c in STEP_COLUMNS} for s in steps], columns=STEP_COLUMNS)


def write_csv(frame: pd.DataFrame, path: Path, replace: bool = False) -> Path:
    return write_file(path, lambda partial: frame.to_csv(partial, index=False), replace=replace)


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def write_json(data: dict[str, Any], path: Path) -> Path:
    return write_text_file(json.dumps(_json_safe(data), indent=2) + "\n", path)


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


SUMMARY_ROWS = [
    ("status", "status"), ("requests", "num_requests"), ("duration (s)", "duration_s"),
    ("request/s", "request_throughput"), ("output tok/s", "output_throughput"),
    ("total tok/s", "total_token_throughput"), ("goodput (req/s)", "goodput"),
    ("TTFT mean (s)", "ttft_s_mean"), ("TTFT p50 (s)", "ttft_s_p50"), ("TTFT p99 (s)", "ttft_s_p99"),
    ("TPOT mean (s)", "tpot_s_mean"), ("TPOT p99 (s)", "tpot_s_p99"), ("ITL p50 (s)", "itl_s_p50"),
    ("E2E p50 (s)", "e2e_s_p50"), ("E2E p99 (s)", "e2e_s_p99"),
    ("client queue p50 (s)", "client_queue_s_p50"), ("E2E incl. client queue p99 (s)", "e2e_including_client_queue_s_p99"),
    ("forward passes", "forward_passes"), ("wasted slots", "wasted_slots"), ("preemptions", "preemptions"),
    ("prefix hit tokens", "prefix_hit_tokens"), ("peak KV used (tok)", "peak_kv_used_tokens"),
    ("peak KV reserved (tok)", "peak_kv_reserved_tokens"), ("mean KV used/reserved", "mean_kv_used_reserved_ratio"),
    ("max running seqs", "max_running_seqs"),
    ("swapped out (bytes)", "swap_out_bytes"), ("swapped in (bytes)", "swap_in_bytes"), ("swap copy time (s)", "swap_time_s"),
]


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's headline numbers as ``(label, formatted value)`` rows (summary.md's and report.html's table)."""
    flat = {"status": summary.get("status"), **summary.get("metrics", {})}
    rows = [(label, _fmt(flat.get(key))) for label, key in SUMMARY_ROWS if key in flat]
    return rows + [(key, _fmt(value)) for key, value in flat.items() if key.startswith("priority_")]


def summary_table(summary: dict[str, Any]) -> str:
    """The run's headline numbers as a two-column Markdown table."""
    lines = ["| metric | value |", "| --- | --- |"]
    lines += [f"| {label} | {value} |" for label, value in summary_rows(summary)]
    return "\n".join(lines)


def rows_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Rows of one table (dicts with the same keys) as a Markdown table, numbers to 4 significant digits."""
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "| " + " | ".join("---" for _ in keys) + " |"]
    lines += ["| " + " | ".join(_fmt(row.get(key)) for key in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def run_title(summary: dict[str, Any]) -> str:
    """``engine=servelab · model=... · cache=paged ...``: what the run was, for page and file titles."""
    run = summary.get("run", {})
    return " · ".join(f"{k}={v}" for k, v in run.items() if k in ("engine", "model", "cache", "scheduler", "attention", "attention_backend", "workload", "hardware"))


def summary_markdown(summary: dict[str, Any]) -> str:
    parts = [f"# servelab run: {run_title(summary)}", ""]
    if summary.get("simulation"):
        parts += [f"**Simulated**: times are {summary['simulation']['timing']}.", ""]
        parts += extrapolation_markdown(summary["simulation"].get("extrapolation"))
    if summary.get("status") != "ok":
        parts += [f"**FAILED**: `{summary.get('error')}`", ""]
    parts += [summary_table(summary), ""]
    if summary.get("samples"):
        parts += ["## Sample answers", ""]
        for sample in summary["samples"]:
            parts += [f"**{sample['request_id']}** ({sample['output_tokens']} tokens, {sample['finish_reason']})", "",
                      _quote(f"Prompt: {sample['prompt']}"), "", _quote(f"Answer: {_clip(sample['answer'])}"), ""]
    return "\n".join(parts)


def sample_answers(records: Sequence[RequestRecord], count: int = 3) -> list[dict[str, Any]]:
    """The first ``count`` requests that have text, for summary.json / summary.md."""
    return [
        {"request_id": r.request_id, "prompt": r.prompt_text, "answer": r.output_text,
         "output_tokens": r.output_tokens, "finish_reason": r.finish_reason}
        for r in records if r.output_text
    ][:count]


def _clip(text: str, limit: int = 600) -> str:
    return text if len(text) <= limit else text[:limit] + " […]"


def _quote(text: str) -> str:
    """``text`` as a Markdown block quote (every line prefixed, blank lines kept)."""
    return "\n".join(f"> {line}" if line else ">" for line in text.splitlines() or [""])
