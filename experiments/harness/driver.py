"""Feed a workload to an engine in real time and collect what comes back.

Requests are submitted at their arrival times (``t0 + arrival_offset_s`` on the engine clock)
through ``add_request``; between arrivals the engine ``step()``s; when the engine is idle and the
next arrival is in the future, the driver sleeps until it (an engine on a virtual clock, the
simulator, has ``advance_clock_to`` and is advanced instead). An optional client-side cap
(``max_concurrency``, like vLLM's ``vllm bench serve --max-concurrency``) keeps at most that
many requests in flight.

The send time (``submit_s``, where TTFT and E2E start, as in vLLM) is what a real client would
have had: the arrival time, or, when the cap held the request back, the moment a slot freed
(the finish time of the request whose slot it takes). A request that arrives while the engine
is busy with a step is handed over when the step ends, but it was *sent* at its arrival: like a
server's queue, that wait is the engine's and counts in TTFT. The engine is told the send time
as the request's ``arrival_time``.

A workload whose requests depend on earlier answers (multi-turn sessions) passes ``follow_ups``
(:class:`~experiments.harness.follow_ups.FollowUps`): each successfully finished request's answer
goes to it, and the requests it returns join the pending ones at their arrival offsets.

Any engine with this small surface can be driven: servelab's ``LLM`` and the HF peers.
"""
from __future__ import annotations

import bisect
import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm import tqdm

from experiments.harness.follow_ups import Answer, FollowUps
from experiments.harness.records import RequestRecord, record_from_output, step_to_dict
from experiments.harness.workloads import WorkloadRequest


class ServingEngine(Protocol):
    """What the driver needs (servelab's ``LLM`` satisfies it; see docs/CONTRACTS.md)."""

    step_records: list[Any]

    def add_request(self, prompt_token_ids: list[int], sampling_params: Any, arrival_time: float | None = None) -> Any: ...

    def step(self) -> list[Any]: ...

    def has_unfinished(self) -> bool: ...

    def clock(self) -> float: ...


@dataclass
class DriveResult:
    """What one run produced: finished requests (workload order) and the engine's step records.

    Drivers that can see failed requests or server-side counters (the HTTP client) also report
    ``extra_metrics`` (merged into the summary's metrics), ``failures`` (request id and reason) and
    ``extra_json`` (more result files: name -> content, e.g. ``vllm_bench.json``).
    """

    records: list[RequestRecord]
    steps: list[dict[str, Any]]
    t0: float
    wall_s: float
    extra_metrics: dict[str, Any] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    extra_json: dict[str, dict[str, Any]] = field(default_factory=dict)


def _relative_steps(steps: list[Any], t0: float) -> list[dict[str, Any]]:
    rows = []
    for step in steps:
        row = step_to_dict(step)
        for key in ("start_time", "end_time"):
            if row.get(key) is not None:
                row[key] = float(row[key]) - t0
        rows.append(row)
    return rows


def drive(
    engine: ServingEngine,
    requests: Sequence[WorkloadRequest],
    max_concurrency: int | None = None,
    progress: bool = True,
    follow_ups: FollowUps | None = None,
) -> DriveResult:
    """Run ``requests`` (and the ``follow_ups`` they lead to) through ``engine`` in real time;
    returns when every request finished."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    pending = deque(sorted(requests, key=lambda r: r.arrival_offset_s))
    issued = list(requests)
    by_engine_id: dict[Any, WorkloadRequest] = {}
    arrival_times: dict[Any, float] = {}
    submit_times: dict[Any, float] = {}
    records: dict[str, RequestRecord] = {}
    first_step = len(engine.step_records)  # earlier records belong to the warm-up
    t0 = engine.clock()
    # when each free client slot became free (a min-heap; one entry per free slot under a cap)
    free_slots: list[float] = [t0] * max_concurrency if max_concurrency is not None else []
    bar = tqdm(total=follow_ups.total_requests if follow_ups else len(requests), desc="requests", unit="req",
               disable=not progress)
    try:
        while pending or engine.has_unfinished():
            now = engine.clock()
            while pending and t0 + pending[0].arrival_offset_s <= now and (max_concurrency is None or free_slots):
                request = pending.popleft()
                arrival = t0 + request.arrival_offset_s
                sent = arrival if max_concurrency is None else max(arrival, heapq.heappop(free_slots))
                engine_id = engine.add_request(request.prompt_token_ids, request.sampling_params, arrival_time=sent)
                by_engine_id[engine_id] = request
                arrival_times[engine_id] = arrival
                submit_times[engine_id] = sent
            if engine.has_unfinished():
                for output in engine.step():
                    if not output.finished:
                        continue
                    request = by_engine_id[output.request_id]
                    records[request.request_id] = record_from_output(
                        output, request.request_id, submit_times[output.request_id], t0,
                        arrival_time=arrival_times[output.request_id])
                    if follow_ups is not None and getattr(output, "finish_reason", None) not in ("abort", "error"):
                        finish = output.finish_time if output.finish_time is not None else engine.clock()
                        answer = Answer(list(output.token_ids), getattr(output, "text", "") or "", finish - t0)
                        for later in follow_ups.after(request, answer):
                            bisect.insort(pending, later, key=lambda r: r.arrival_offset_s)
                            issued.append(later)
                    if max_concurrency is not None:
                        heapq.heappush(free_slots, output.finish_time if output.finish_time is not None else engine.clock())
                    bar.update(1)
            elif pending:
                wait_until(engine, t0 + pending[0].arrival_offset_s)
    finally:
        bar.close()
    wall = engine.clock() - t0
    ordered = [records[r.request_id] for r in issued if r.request_id in records]
    return DriveResult(records=ordered, steps=_relative_steps(list(engine.step_records)[first_step:], t0), t0=t0, wall_s=wall)


def wait_until(engine: ServingEngine, time_s: float) -> None:
    """Idle until ``time_s`` on the engine clock: sleep, or advance a virtual clock (the simulator)."""
    advance = getattr(engine, "advance_clock_to", None)
    if advance is not None:
        advance(time_s)
    else:
        time.sleep(max(0.0, time_s - engine.clock()))


def warm_up(engine: ServingEngine, requests: Sequence[WorkloadRequest]) -> None:
    """Run ``requests`` to completion untimed (first-call costs: allocator, kernels, thread pools)."""
    for request in requests:
        engine.add_request(request.prompt_token_ids, request.sampling_params)
    while engine.has_unfinished():
        engine.step()
