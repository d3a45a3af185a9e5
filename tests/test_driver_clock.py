"""The driver's send time (vLLM's clock start) on a scripted engine with a virtual clock.

The fake engine takes one virtual second per step and finishes a request after ``steps``
steps, so every time the driver records is known exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from experiments.harness.driver import drive
from experiments.harness.metrics import e2e, e2e_including_client_queue, ttft
from experiments.harness.workloads import WorkloadRequest


@dataclass
class ScriptedEngine:
    """Each request needs ``steps_per_request`` one-second steps; one token per step."""

    steps_per_request: int
    now: float = 0.0
    step_records: list = field(default_factory=list)
    running: dict[int, dict] = field(default_factory=dict)
    arrivals: dict[int, float] = field(default_factory=dict)
    next_id: int = 0

    def clock(self) -> float:
        return self.now

    def add_request(self, prompt_token_ids, sampling_params, arrival_time=None) -> int:
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.running[request_id] = {"prompt": list(prompt_token_ids), "times": []}
        self.arrivals[request_id] = arrival_time
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        start, self.now = self.now, self.now + 1.0
        self.step_records.append({"step": len(self.step_records), "start_time": start, "end_time": self.now})
        outputs = []
        for request_id, state in list(self.running.items()):
            state["times"].append(self.now)
            finished = len(state["times"]) == self.steps_per_request
            outputs.append(RequestOutput(
                request_id=request_id, prompt_token_ids=state["prompt"], token_ids=[7] * len(state["times"]),
                finished=finished, finish_reason="length" if finished else None, arrival_time=self.arrivals[request_id],
                first_scheduled_time=start, first_token_time=state["times"][0], token_times=list(state["times"]),
                finish_time=self.now if finished else None,
            ))
            if finished:
                del self.running[request_id]
        return outputs


def workload(*arrivals: float) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"req-{i}", [5, 6, 7], SamplingParams(max_tokens=3), offset) for i, offset in enumerate(arrivals)]


def test_client_cap_wait_is_client_queue_not_ttft() -> None:
    engine = ScriptedEngine(steps_per_request=3)
    first, second = drive(engine, workload(0.0, 0.0), max_concurrency=1, progress=False).records
    assert (first.submit_s, first.client_queue_s, ttft(first), e2e(first)) == (0.0, 0.0, 1.0, 3.0)
    # held back by the cap until the first finished at 3.0: sent then, its clock starts then
    assert second.arrival_s == 0.0 and second.submit_s == pytest.approx(3.0)
    assert second.client_queue_s == pytest.approx(3.0)
    assert ttft(second) == pytest.approx(1.0) and e2e(second) == pytest.approx(3.0)
    assert e2e_including_client_queue(second) == pytest.approx(6.0)
    assert engine.arrivals[1] == pytest.approx(3.0)  # the engine is told the send time


def test_arrival_during_a_busy_step_counts_as_sent_at_arrival() -> None:
    engine = ScriptedEngine(steps_per_request=3)
    _, late = drive(engine, workload(0.0, 0.5), max_concurrency=None, progress=False).records
    # handed over at 1.0 (end of the running step) but sent at 0.5: that wait is the engine's
    assert late.submit_s == pytest.approx(0.5) and late.client_queue_s == 0.0
    assert ttft(late) == pytest.approx(2.0 - 0.5)


def test_capped_send_is_the_later_of_arrival_and_slot_release() -> None:
    engine = ScriptedEngine(steps_per_request=1)
    # the only slot frees at 1.0 (the first request's finish); the second arrived at 0.25
    _, second = drive(engine, workload(0.0, 0.25), max_concurrency=1, progress=False).records
    assert second.submit_s == pytest.approx(1.0) and second.client_queue_s == pytest.approx(0.75)
    engine = ScriptedEngine(steps_per_request=1)
    # two slots: the second request never waits for the cap, whatever the engine is doing
    _, second = drive(engine, workload(0.0, 0.25), max_concurrency=2, progress=False).records
    assert second.submit_s == pytest.approx(0.25) and second.client_queue_s == 0.0
