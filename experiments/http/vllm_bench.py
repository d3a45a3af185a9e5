"""``vllm_bench.json``: an HTTP run in the format of ``vllm bench serve --save-result --save-detailed``.

Same keys, same definitions (``vllm/benchmarks/serve.py``, ``calculate_metrics``), so tools that
read vLLM's result files read ours, and numbers compare one to one with a ``vllm bench serve``
run against the same server:

* ``duration``: from before the first request is scheduled to after the last one returned;
* only successful requests enter the statistics; ``failed`` counts the others (``errors`` has
  every request's reason, "" for successes); ``output_lens`` is 0 for failed requests;
* TPOT = (latency - TTFT) / (output_len - 1) for outputs longer than one token; ITL pools every
  gap between token chunks; latency (E2EL) is send to last token chunk; times in ms;
* goodput counts requests within every bound of the run's SLO (``slo`` in config.yaml);
* ``max_output_tokens_per_s``: the busiest one-second bucket of token chunks;
  ``max_concurrent_requests``: the most requests in flight at once (send to last token);
* client-side queueing (``client_queue_time``, and E2EL including it when arrivals are spread
  out) is reported when a concurrency cap was set, as vLLM does.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import numpy as np

from experiments.http.client import HTTPOutcome
from experiments.harness.metrics import SLO

PERCENTILES = (50, 90, 99)
# The top-level keys `vllm bench serve --save-result --save-detailed` writes for a generation run.
VLLM_RESULT_KEYS = (
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times", "generated_texts",
    "errors", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms",
)


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    """vLLM's mean / median / std / p<N> in ms (0 for an empty list, as vLLM's ``values or 0``)."""
    data = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000
    out = {f"mean_{name}_ms": float(data.mean()), f"median_{name}_ms": float(np.median(data)),
           f"std_{name}_ms": float(data.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(data, p)) for p in PERCENTILES})
    return out


def _tpot(outcome: HTTPOutcome) -> float | None:
    n = outcome.num_output_tokens
    return (outcome.latency - outcome.ttft) / (n - 1) if n > 1 else None


def _meets(outcome: HTTPOutcome, slo: SLO) -> bool:
    checks = ((slo.ttft_s, outcome.ttft), (slo.tpot_s, _tpot(outcome) or 0.0), (slo.e2e_s, outcome.latency))
    return all(bound is None or value <= bound for bound, value in checks)


def _peaks(ok: Sequence[HTTPOutcome]) -> tuple[float, int]:
    """(busiest one-second bucket of token chunks, peak requests in flight)."""
    if not ok:
        return 0.0, 0
    begin = min(o.start for o in ok)
    end = max(o.start + o.latency for o in ok)
    buckets = np.zeros(int(math.ceil(end - begin)) + 1)
    for outcome in ok:
        for t in outcome.chunk_times:
            buckets[int(t - begin)] += 1
    events = sorted([(o.start, 1) for o in ok] + [(o.start + o.latency, -1) for o in ok])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return float(buckets.max()), peak


def vllm_bench_result(outcomes: Sequence[HTTPOutcome], duration_s: float, backend: str, model_id: str,
                      tokenizer_id: str | None, request_rate: float | str, burstiness: float,
                      max_concurrency: int | None, slo: SLO, label: str | None = None) -> dict[str, Any]:
    """The result dict (see the module docstring); keys in :data:`VLLM_RESULT_KEYS` plus p50/p90 stats."""
    ok = [o for o in outcomes if o.success]
    output_lens = [o.num_output_tokens if o.success else 0 for o in outcomes]
    total_input = sum(o.prompt_tokens if o.prompt_tokens is not None else len(o.request.prompt_token_ids) for o in ok)
    total_output = sum(output_lens)
    good = sum(_meets(o, slo) for o in ok)
    max_tokens_per_s, max_concurrent = _peaks(ok)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend, "backend": backend, "label": label, "model_id": model_id,
        "tokenizer_id": tokenizer_id, "num_prompts": len(outcomes),
        "request_rate": request_rate, "burstiness": burstiness, "max_concurrency": max_concurrency,
        "duration": duration_s, "completed": len(ok), "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s, "request_goodput": good / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "input_lens": [o.prompt_tokens if o.prompt_tokens is not None else len(o.request.prompt_token_ids)
                       for o in outcomes],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outcomes], "itls": [o.itls for o in outcomes],
        "latencies": [o.latency for o in outcomes], "start_times": [o.start for o in outcomes],
        "queue_times": [o.start - o.arrival for o in outcomes],
        "generated_texts": [o.text for o in outcomes], "errors": [o.error for o in outcomes],
        "max_output_tokens_per_s": max_tokens_per_s, "max_concurrent_requests": max_concurrent, "rtfx": 0.0,
    }
    result.update(_stats("ttft", [o.ttft for o in ok]))
    result.update(_stats("tpot", [t for t in map(_tpot, ok) if t is not None]))
    result.update(_stats("itl", [gap for o in ok for gap in o.itls]))
    result.update(_stats("e2el", [o.latency for o in ok]))
    if max_concurrency is not None:
        result.update(_stats("client_queue_time", [o.start - o.arrival for o in ok]))
        if request_rate != "inf":
            result.update(_stats("e2el_including_client_queue", [o.latency + o.start - o.arrival for o in ok]))
    return result
