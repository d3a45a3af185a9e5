"""Serving metrics against hand-computed values on synthetic timestamps."""
from __future__ import annotations

import dataclasses
import math

import pytest

from experiments.harness.metrics import (
    SLO, decode_points, decode_seconds_per_1k_context, distribution, e2e, e2e_including_client_queue, itls, meets_slo,
    priority_class_metrics, queue_time, queued_steps, queueing_metrics, request_metrics, step_metrics, tpot, ttft,
)
from experiments.harness.records import RequestRecord


def record(name: str, arrival: float, token_times: list[float], prompt: int = 10, scheduled: float | None = None,
           submit: float | None = None) -> RequestRecord:
    return RequestRecord(
        request_id=name, engine_request_id=name, prompt_tokens=prompt, output_tokens=len(token_times),
        arrival_s=arrival, submit_s=arrival if submit is None else submit, first_scheduled_s=scheduled,
        first_token_s=token_times[0], finish_s=token_times[-1], token_times_s=token_times,
    )


A = record("a", 0.0, [0.5, 0.7, 1.0, 1.1], prompt=10, scheduled=0.1)  # ttft .5, e2e 1.1, tpot .2
B = record("b", 1.0, [3.0], prompt=20)                                 # ttft 2, e2e 2, 1 token: no tpot
C = record("c", 2.0, [2.2, 2.4, 2.6], prompt=30)                       # ttft .2, e2e .6, tpot .2


def test_per_request_definitions() -> None:
    assert ttft(A) == pytest.approx(0.5)
    assert e2e(A) == pytest.approx(1.1)
    assert tpot(A) == pytest.approx((1.1 - 0.5) / 3)
    assert itls(A) == pytest.approx([0.2, 0.3, 0.1])
    assert tpot(B) is None and itls(B) == []


def test_latency_clock_starts_at_send_and_client_queue_is_separate() -> None:
    # arrived at 1.0, held back by the client-side cap until 3.0, scheduled at 3.5, tokens at 4, 4.5, 5
    held = record("held", 1.0, [4.0, 4.5, 5.0], scheduled=3.5, submit=3.0)
    assert ttft(held) == pytest.approx(1.0) and e2e(held) == pytest.approx(2.0)  # from the send (vLLM)
    assert held.client_queue_s == pytest.approx(2.0)
    assert e2e_including_client_queue(held) == pytest.approx(4.0)
    assert queue_time(held) == pytest.approx(0.5)  # engine queue only
    m = request_metrics([held], SLO(ttft_s=1.5, e2e_s=2.5))
    assert m["num_good_requests"] == 1  # the SLOs see the latency from the send, not the client wait
    assert m["client_queue_s_p50"] == pytest.approx(2.0) and m["e2e_including_client_queue_s_p50"] == pytest.approx(4.0)
    assert m["duration_s"] == pytest.approx(4.0)  # the run still spans first arrival to last finish


def test_distribution_matches_numpy_linear_percentiles() -> None:
    stats = distribution([1.0, 2.0, 3.0, 4.0])
    assert stats["mean"] == pytest.approx(2.5)
    assert stats["p50"] == pytest.approx(2.5)
    assert stats["p90"] == pytest.approx(3.7)
    assert stats["p99"] == pytest.approx(3.97)
    assert distribution([])["p50"] is None


def test_run_metrics() -> None:
    m = request_metrics([A, B, C], SLO())
    assert m["duration_s"] == pytest.approx(3.0)  # first arrival 0 -> last finish 3.0
    assert m["total_prompt_tokens"] == 60 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(8 / 3)
    assert m["total_token_throughput"] == pytest.approx(68 / 3)
    assert m["ttft_s_mean"] == pytest.approx((0.5 + 2.0 + 0.2) / 3)
    # TPOT excludes the 1-token request B
    assert m["tpot_s_mean"] == pytest.approx(((0.6 / 3) + 0.2) / 2)
    # ITLs are pooled over requests: A's 3 gaps and C's 2
    assert m["itl_s_mean"] == pytest.approx((0.2 + 0.3 + 0.1 + 0.2 + 0.2) / 5)
    assert m["queue_s_mean"] == pytest.approx(0.1)  # only A reports first_scheduled
    assert m["goodput"] == pytest.approx(1.0)  # no SLO: every request is good
    assert m["prefix_hit_rate"] == 0.0
    shared = dataclasses.replace(C, num_cached_tokens=16)  # 16 of C's 30 prompt tokens were cache hits
    assert request_metrics([A, B, shared], SLO())["prefix_hit_rate"] == pytest.approx(16 / 60)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.2 + 1e-9)
    assert meets_slo(A, slo) and meets_slo(C, slo)
    assert not meets_slo(B, slo)  # TTFT 2 s > 1 s
    assert meets_slo(B, SLO(tpot_s=0.0))  # a 1-token output has TPOT 0 for goodput (vLLM)
    m = request_metrics([A, B, C], slo)
    assert m["num_good_requests"] == 2
    assert m["goodput"] == pytest.approx(2 / 3.0)
    assert request_metrics([A, B, C], SLO(e2e_s=1.0))["num_good_requests"] == 1  # only C


def test_step_aggregates_and_missing_columns() -> None:
    steps = [
        {"num_wasted_slots": 2, "forward_passes": 1, "num_preempted": 0, "prefix_hit_tokens": 16,
         "kv_used_tokens": 30, "kv_reserved_tokens": 60, "kv_capacity_tokens": 128, "num_running": 3, "num_seqs": 4,
         "duration_s": 0.1},
        {"num_wasted_slots": 1, "forward_passes": 1, "num_preempted": 1, "prefix_hit_tokens": 0,
         "kv_used_tokens": 40, "kv_reserved_tokens": 50, "kv_capacity_tokens": 128, "num_running": 2, "num_seqs": 2,
         "duration_s": 0.3},
    ]
    m = step_metrics(steps)
    assert (m["wasted_slots"], m["forward_passes"], m["preemptions"], m["prefix_hit_tokens"]) == (3, 2, 1, 16)
    assert (m["peak_kv_used_tokens"], m["peak_kv_reserved_tokens"], m["max_running_seqs"]) == (40, 60, 3)
    # time averages: the 0.3 s step weighs three times the 0.1 s step
    assert m["mean_kv_used_reserved_ratio"] == pytest.approx((0.5 * 0.1 + 0.8 * 0.3) / 0.4)
    assert m["mean_kv_used_fraction"] == pytest.approx((30 / 128 * 0.1 + 40 / 128 * 0.3) / 0.4)
    assert m["step_time_s_mean"] == pytest.approx(0.2)
    empty = step_metrics([{"kv_capacity_tokens": None, "kv_used_tokens": math.nan}])
    assert empty["kv_capacity_tokens"] is None and empty["mean_kv_used_reserved_ratio"] is None


def test_decode_cost_per_1k_context_tokens() -> None:
    # duration = 0.05 s + 13.5 ms per 1,000 tokens; the prefill step is ignored
    steps = [{"num_prefill_tokens": 0, "num_decode_tokens": 4, "kv_used_tokens": kv, "duration_s": 0.05 + 13.5e-6 * kv}
             for kv in (1000, 2000, 4000, 8000)]
    steps.append({"num_prefill_tokens": 500, "num_decode_tokens": 0, "kv_used_tokens": 500, "duration_s": 9.0})
    points = decode_points(steps)
    assert len(points) == 4
    assert decode_seconds_per_1k_context(points) == pytest.approx(0.0135)
    assert decode_seconds_per_1k_context(points[:1]) is None
    m = step_metrics(steps)
    assert m["decode_step_s_p50"] == pytest.approx(0.05 + 13.5e-6 * 3000)
    assert m["decode_kv_tokens_p50"] == pytest.approx(3000)


def test_queued_steps_counts_steps_run_while_waiting() -> None:
    steps = [{"start_time": t} for t in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)]
    late = record("late", 0.05, [0.6], scheduled=0.4)  # steps at 0.1, 0.2, 0.3 ran while it waited
    assert queued_steps(late, steps) == 3
    assert queued_steps(A, steps) == 1  # arrived at 0.0, first scheduled at 0.1: the 0.0 step ran without it
    assert queued_steps(B, steps) is None  # the engine did not say when it was scheduled
    assert queueing_metrics([A, late, B], steps) == {"max_queued_steps": 3}
    assert queueing_metrics([A], []) == {"max_queued_steps": None}


def test_report_fits_decode_cost_across_runs_of_different_context() -> None:
    import pandas as pd

    from experiments.results.report import decode_scaling_lines

    kv = [1000.0, 2000.0, 4000.0]
    frame = pd.DataFrame({
        "job": ["0", "1", "2"], "status": ["ok"] * 3, "override:workload.context_len": [250, 500, 1000],
        "decode_kv_tokens_p50": kv, "decode_step_s_p50": [0.05 + 13.5e-6 * x for x in kv],
    })
    assert "13.5 ms per 1,000 context tokens summed over the batch" in decode_scaling_lines(frame)[0]
    assert decode_scaling_lines(frame.drop(columns="override:workload.context_len")) == []


def test_priority_class_metrics_split_latency_by_class() -> None:
    assert priority_class_metrics([A, B, C]) == {}  # one class: nothing extra
    urgent = [dataclasses.replace(A, priority=0), dataclasses.replace(C, priority=0)]
    metrics = priority_class_metrics([*urgent, dataclasses.replace(B, priority=1)])
    assert metrics["priority_0_num_requests"] == 2 and metrics["priority_1_num_requests"] == 1
    assert metrics["priority_0_ttft_s_p50"] == pytest.approx((0.5 + 0.2) / 2)
    assert metrics["priority_1_ttft_s_p99"] == pytest.approx(2.0)
    assert metrics["priority_0_e2e_s_p99"] == pytest.approx(1.1 - 0.01 * (1.1 - 0.6))


def test_step_metrics_sum_swap_traffic() -> None:
    steps = [{"swap_out_blocks": 3, "swap_in_blocks": 0, "swap_out_bytes": 300, "swap_in_bytes": 0, "swap_time_s": 0.25},
             {"swap_out_blocks": 0, "swap_in_blocks": 2, "swap_out_bytes": 0, "swap_in_bytes": 200, "swap_time_s": 0.5}]
    metrics = step_metrics(steps)
    assert (metrics["swap_out_blocks"], metrics["swap_in_blocks"]) == (3, 2)
    assert (metrics["swap_out_bytes"], metrics["swap_in_bytes"]) == (300, 200)
    assert metrics["swap_time_s"] == pytest.approx(0.75)
    assert step_metrics([{"duration_s": 1.0}])["swap_time_s"] is None  # an engine without the columns
