"""Scheduling policies: who is admitted first, and who is preempted first when memory runs dry.

A policy is one *ranking* of sequences; the scheduler uses it both ways round:

* **admission**: the waiting queue is served in rank order (best first). The scheduler still
  stops at the first request that does not fit (head-of-line blocking, as vLLM does), so a
  large best-ranked request is never overtaken by smaller worse-ranked ones;
* **running order and victims**: running sequences get their tokens (and the step's token
  budget) in rank order, and a preemptive scheduler preempts the *worst*-ranked one first.

Policies (``scheduler.policy``):

``fcfs``
    First come, first served: arrival order; preempted sequences go back to the front of the
    queue, the youngest running sequence is the victim. The queue and running lists are
    already in this order, so ``fcfs`` never reorders them.
``priority``
    ``SamplingParams.priority`` (an int, lower = served first, default 0), ties in arrival
    order. The victim is the lowest priority (largest value), then the youngest — vLLM's
    ``--scheduling-policy priority``. A stream of urgent requests can starve low-priority ones:
    that is the policy's promise, not a bug.
``sjf``
    Shortest job first: rank by the request's whole job, prompt + ``max_tokens``, ties in
    arrival order; the victim is the longest job. Pure SJF starves a long request while short
    ones keep arriving, so it has an **aging bound**: a request that has waited
    ``sjf_aging_steps`` scheduler steps since it arrived is *aged* and moves into a FCFS lane
    ranked ahead of every unaged request (and an aged running request is preempted only after
    every unaged one). An aged request then waits at most for the aged requests that arrived
    before it — a finite set — plus one admission; its total wait is bounded by
    ``sjf_aging_steps`` steps plus the service of older aged requests.

Aging counts scheduler steps, not seconds, so the same arrivals give the same order on any
machine (and the tests can state the bound exactly).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.sequence import Sequence

POLICIES = ("fcfs", "priority", "sjf")


@dataclass(frozen=True)
class SchedulingPolicy:
    """A ranking of sequences; lower rank = served first, preempted last.

    Attributes:
        name: one of :data:`POLICIES`.
        sjf_aging_steps: ``sjf`` only: scheduler steps a request may wait before it is aged
            (promoted into the FCFS lane ahead of all unaged requests). At least 1.
    """

    name: str = "fcfs"
    sjf_aging_steps: int = 64

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.name!r}; supported: {', '.join(POLICIES)}")
        if isinstance(self.sjf_aging_steps, bool) or not isinstance(self.sjf_aging_steps, int) or self.sjf_aging_steps < 1:
            raise ValueError(f"sjf_aging_steps must be an integer >= 1, got {self.sjf_aging_steps!r}")

    @property
    def reorders(self) -> bool:
        """False for ``fcfs``: the scheduler's own queue order already is the policy."""
        return self.name != "fcfs"

    def rank(self, seq: Sequence, arrival_step: int, now_step: int) -> tuple:
        """The sort key of ``seq`` at scheduler step ``now_step``; it arrived at ``arrival_step``.

        Ties are broken by ``(arrival_time, seq_id)``: first come first.
        """
        arrival = (seq.arrival_time, seq.seq_id)
        if self.name == "priority":
            return (seq.sampling_params.priority, *arrival)
        if self.name == "sjf":
            if now_step - arrival_step >= self.sjf_aging_steps:
                return (0, 0, *arrival)  # aged: the FCFS lane ahead of every unaged request
            return (1, seq.max_total_tokens, *arrival)
        return arrival

    def order(self, seqs: Iterable[Sequence], arrival_steps: dict[int, int], now_step: int) -> list[Sequence]:
        """``seqs`` best-ranked first (unchanged for ``fcfs``)."""
        seqs = list(seqs)
        if not self.reorders:
            return seqs
        return sorted(seqs, key=lambda seq: self.rank(seq, arrival_steps[seq.seq_id], now_step))
