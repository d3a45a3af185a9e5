"""Serving metrics with exactly the definitions of vLLM's serving benchmark.

Per request (times from :class:`~experiments.harness.records.RequestRecord`). As in ``vllm bench
serve``, the latency clock starts when the client *sends* the request (``submit_s``, after any
client-side concurrency cap); the wait behind the cap is reported on its own:

* TTFT = first token - send
* E2E  = finish - send
* TPOT = (E2E - TTFT) / (output_tokens - 1); undefined for 1-token outputs, which are
  excluded from TPOT statistics (and, as in vLLM, count as TPOT 0 for goodput)
* ITL  = gaps between consecutive token times (all gaps of all requests pooled)
* client queue = send - arrival (vLLM's ``client_queue_time``); E2E including the client queue
  = finish - arrival (vLLM's ``e2el_including_client_queue``)
* engine queue = first scheduled step - send

Per run: duration = first arrival to last finish; request/s, output tok/s, total tok/s
(prompt + output) over that duration; goodput = requests meeting every SLO (TTFT, TPOT, E2E as
above, so from the send) per second. Each latency gets mean / p50 / p90 / p99
(``numpy.percentile``, linear interpolation). Engine-side aggregates come from the per-step
records; means over steps are weighted by step duration (a time average: a 5-second prefill
step counts 100 times a 50 ms decode step).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from experiments.harness.records import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput; ``None`` disables a bound."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None


def ttft(record: RequestRecord) -> float:
    return record.first_token_s - record.submit_s


def e2e(record: RequestRecord) -> float:
    return record.finish_s - record.submit_s


def e2e_including_client_queue(record: RequestRecord) -> float:
    """Finish - arrival (vLLM's ``e2el_including_client_queue``)."""
    return record.finish_s - record.arrival_s


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first; ``None`` for outputs of fewer than 2 tokens."""
    if record.output_tokens < 2:
        return None
    return (e2e(record) - ttft(record)) / (record.output_tokens - 1)


def itls(record: RequestRecord) -> list[float]:
    times = record.token_times_s
    return [later - earlier for earlier, later in zip(times, times[1:])]


def queue_time(record: RequestRecord) -> float | None:
    """Send to first scheduled step: the wait in the engine's queue (not the client cap)."""
    return None if record.first_scheduled_s is None else record.first_scheduled_s - record.submit_s


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    request_tpot = tpot(record)
    checks = (
        (slo.ttft_s, ttft(record)),
        (slo.tpot_s, 0.0 if request_tpot is None else request_tpot),
        (slo.e2e_s, e2e(record)),
    )
    return all(bound is None or value <= bound for bound, value in checks)


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 (``None`` each when there are no values)."""
    data = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if data.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    return {"mean": float(data.mean()), **{f"p{p}": float(np.percentile(data, p)) for p in PERCENTILES}}


def run_duration(records: Sequence[RequestRecord]) -> float:
    """First arrival to last finish."""
    if not records:
        return 0.0
    return max(r.finish_s for r in records) - min(r.arrival_s for r in records)


def _per_second(count: float, duration: float) -> float | None:
    return count / duration if duration > 0 else None


def request_metrics(records: Sequence[RequestRecord], slo: SLO) -> dict[str, Any]:
    """Run-level client metrics (flat dict, keys like ``ttft_s_p99``)."""
    duration = run_duration(records)
    prompt = sum(r.prompt_tokens for r in records)
    output = sum(r.output_tokens for r in records)
    good = sum(meets_slo(r, slo) for r in records)
    metrics: dict[str, Any] = {
        "num_requests": len(records),
        "duration_s": duration,
        "total_prompt_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": _per_second(len(records), duration),
        "output_throughput": _per_second(output, duration),
        "total_token_throughput": _per_second(prompt + output, duration),
        "num_good_requests": good,
        "goodput": _per_second(good, duration),
        # share of prompt tokens served by prefix-cache hits (vLLM's prefix cache hit rate, in tokens)
        "prefix_hit_rate": sum(r.num_cached_tokens for r in records) / prompt if prompt else None,
    }
    series = {
        "ttft_s": [ttft(r) for r in records],
        "tpot_s": [tpot(r) for r in records],
        "itl_s": [gap for r in records for gap in itls(r)],
        "e2e_s": [e2e(r) for r in records],
        "queue_s": [queue_time(r) for r in records],
        "client_queue_s": [r.client_queue_s for r in records],
        "e2e_including_client_queue_s": [e2e_including_client_queue(r) for r in records],
    }
    for name, values in series.items():
        for stat, value in distribution(values).items():
            metrics[f"{name}_{stat}"] = value
    return metrics


def _column(steps: Sequence[dict[str, Any]], name: str) -> list[float]:
    return [float(s[name]) for s in steps if s.get(name) is not None and not _is_nan(s[name])]


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _total(steps: Sequence[dict[str, Any]], name: str) -> int | None:
    values = _column(steps, name)
    return int(sum(values)) if values else None


def _peak(steps: Sequence[dict[str, Any]], name: str) -> int | None:
    values = _column(steps, name)
    return int(max(values)) if values else None


def _present(step: dict[str, Any], name: str) -> bool:
    return step.get(name) is not None and not _is_nan(step[name])


def time_weighted_mean(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Mean of ``value`` over ``(value, duration_s)`` pairs weighted by duration (a time average).
    Falls back to the plain mean when no step has a positive duration."""
    if not pairs:
        return None
    values, weights = np.array(pairs, dtype=np.float64).T
    return float(np.average(values, weights=weights)) if weights.sum() > 0 else float(values.mean())


def kv_used_reserved_ratio(steps: Sequence[dict[str, Any]]) -> float | None:
    """Time average (weighted by step duration) over steps with any reservation of used / reserved
    KV tokens: 1.0 = no reserved-but-unused KV."""
    return time_weighted_mean([
        (float(s["kv_used_tokens"]) / float(s["kv_reserved_tokens"]), float(s.get("duration_s") or 0.0))
        for s in steps
        if _present(s, "kv_used_tokens") and _present(s, "kv_reserved_tokens") and float(s["kv_reserved_tokens"]) > 0
    ])


def kv_used_fraction(steps: Sequence[dict[str, Any]]) -> float | None:
    """Time average (weighted by step duration) of used / capacity KV tokens (vLLM's KV cache usage)."""
    return time_weighted_mean([
        (float(s["kv_used_tokens"]) / float(s["kv_capacity_tokens"]), float(s.get("duration_s") or 0.0))
        for s in steps
        if _present(s, "kv_used_tokens") and _present(s, "kv_capacity_tokens") and float(s["kv_capacity_tokens"]) > 0
    ])


def decode_points(steps: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(kv_used_tokens, duration_s)`` of every decode-only step (no prefill tokens)."""
    return [
        (float(s["kv_used_tokens"]), float(s["duration_s"]))
        for s in steps
        if s.get("num_prefill_tokens") == 0 and s.get("num_decode_tokens")
        and s.get("kv_used_tokens") is not None and s.get("duration_s") is not None
        and not _is_nan(s["kv_used_tokens"]) and not _is_nan(s["duration_s"])
    ]


def decode_seconds_per_1k_context(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of decode-step seconds vs context (KV) tokens, per 1,000 tokens
    (nano-vLLM's "ms per 1,000 context tokens"). The context is the step's ``kv_used_tokens``:
    summed over every sequence of the batch, so the slope is the cost of one step per 1,000
    context tokens *in the batch* (not per sequence). Fit it *across* runs of different context
    sizes (the report does, from each run's median decode step): inside one run the context
    grows by a few tokens only. ``None`` with fewer than 2 distinct context sizes."""
    if len({x for x, _ in points}) < 2:
        return None
    x, y = np.array(points).T
    return float(np.polyfit(x, y, 1)[0] * 1000.0)


def queued_steps(record: RequestRecord, steps: Sequence[dict[str, Any]]) -> int | None:
    """Engine steps that ran while the request waited in the engine (send to first scheduled step):
    pico-vllm's "queued for N decode steps". ``None`` if the engine does not report steps."""
    if record.first_scheduled_s is None or not steps:
        return None
    return sum(1 for s in steps if record.submit_s <= float(s["start_time"]) < record.first_scheduled_s)


def queueing_metrics(records: Sequence[RequestRecord], steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The longest wait of any request, counted in engine steps."""
    counts = [c for c in (queued_steps(r, steps) for r in records) if c is not None]
    return {"max_queued_steps": max(counts) if counts else None}


def step_metrics(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Engine-side aggregates from per-step records (``None`` where an engine doesn't report a column).

    ``prefix_hit_tokens`` is summed: each step record carries the hits of that step. KV means
    are weighted by step duration.
    """
    return {
        "num_steps": len(steps),
        "forward_passes": _total(steps, "forward_passes"),
        "wasted_slots": _total(steps, "num_wasted_slots"),
        "preemptions": _total(steps, "num_preempted"),
        "prefix_hit_tokens": _total(steps, "prefix_hit_tokens"),
        "prefill_tokens": _total(steps, "num_prefill_tokens"),
        "decode_tokens": _total(steps, "num_decode_tokens"),
        "peak_kv_used_tokens": _peak(steps, "kv_used_tokens"),
        "peak_kv_reserved_tokens": _peak(steps, "kv_reserved_tokens"),
        "kv_capacity_tokens": _peak(steps, "kv_capacity_tokens"),
        "mean_kv_used_reserved_ratio": kv_used_reserved_ratio(steps),
        "mean_kv_used_fraction": kv_used_fraction(steps),
        "max_running_seqs": _peak(steps, "num_running"),
        "max_batch_seqs": _peak(steps, "num_seqs"),
        "step_time_s_mean": distribution(_column(steps, "duration_s"))["mean"],
        "decode_step_s_p50": _median([duration for _, duration in decode_points(steps)]),
        "decode_kv_tokens_p50": _median([kv for kv, _ in decode_points(steps)]),
        # swap preemption (scheduler.preemption_mode=swap): host <-> KV-cache copies
        "swap_out_blocks": _total(steps, "swap_out_blocks"),
        "swap_in_blocks": _total(steps, "swap_in_blocks"),
        "swap_out_bytes": _total(steps, "swap_out_bytes"),
        "swap_in_bytes": _total(steps, "swap_in_bytes"),
        "swap_time_s": float(sum(_column(steps, "swap_time_s"))) if _column(steps, "swap_time_s") else None,
    }


def priority_class_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Latency per priority class (``priority_<p>_ttft_s_p50`` ...), when a run has more than one class.

    The point of a scheduling policy is who waits: under memory pressure ``priority`` should
    cut the interactive class's TTFT at the batch class's expense, FCFS treats both alike.
    """
    classes = sorted({r.priority for r in records})
    if len(classes) < 2:
        return {}
    metrics: dict[str, Any] = {}
    for priority in classes:
        members = [r for r in records if r.priority == priority]
        prefix = f"priority_{priority}_"
        metrics[prefix + "num_requests"] = len(members)
        for name, values in (("ttft_s", [ttft(r) for r in members]), ("e2e_s", [e2e(r) for r in members]),
                             ("queue_s", [queue_time(r) for r in members])):
            stats = distribution(values)
            metrics.update({f"{prefix}{name}_{stat}": stats[stat] for stat in ("p50", "p99")})
    return metrics
