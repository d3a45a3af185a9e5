"""What a scheduler decides each step, and the record of that decision.

The scheduler owns the waiting queue and the running set. Each step it picks, for every
sequence it runs, how many new tokens to compute — a whole prompt, a prefill chunk, or one
decode token — asks the cache strategy for room, and may preempt sequences to make room.
Because every step is "some tokens per sequence", prefill, decode, chunked prefill, prefix hits
and recompute after preemption share one code path in the runner.

Liveness: a scheduler rejects, before it is queued, any request it could never run
(``validate_request``), so a step with work pending always schedules something. If one does
not (a bug, or a limit nobody thought of), the engine raises :class:`SchedulerStalled` with the
scheduler's ``explain_stall()`` instead of returning empty steps forever. Invariants are checked
with real exceptions (:class:`SchedulerInvariantError`), so they hold under ``python -O`` too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engine.sequence import Sequence


class SchedulerInvariantError(RuntimeError):
    """A scheduler broke one of its own invariants (a bug): raised, never asserted."""


class SchedulerStalled(RuntimeError):
    """Work is pending but nothing can ever be scheduled: no running sequence will free memory
    and the head of the queue does not fit. The message names the request and the limit."""


@dataclass
class ScheduledSequence:
    """One row group of the step's flat batch.

    Attributes:
        seq: the sequence.
        num_new_tokens: tokens of ``seq`` computed this step, starting at ``seq.num_computed_tokens``.
        is_padding: a finished member of a static batch that still occupies (and computes in)
            its slot: the runner recomputes its last token, the result is discarded. A wasted slot.
    """

    seq: Sequence
    num_new_tokens: int
    is_padding: bool = False


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_waiting: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def num_wasted_slots(self) -> int:
        return sum(1 for item in self.scheduled if item.is_padding)


@runtime_checkable
class Scheduler(Protocol):
    """Built by ``hydra.utils.instantiate(cfg, cache=cache, max_model_len=...)``."""

    def validate_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``ValueError`` naming the limit if this scheduler, as configured, could never
        run such a request (even alone); otherwise return. No side effects."""

    def add(self, seq: Sequence) -> None:
        """Queue a new request (status WAITING); validates it first."""

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch. Checks its invariants (raising
        :class:`SchedulerInvariantError`) before returning."""

    def retire(self, finished: list[Sequence]) -> None:
        """Called after the step with the sequences that just finished; frees what it may."""

    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` (waiting, running or preempted) for good and free any memory it holds."""

    def has_unfinished(self) -> bool:
        """Anything waiting, running, or occupying a slot."""

    def explain_stall(self) -> str:
        """Why the last ``schedule()`` scheduled nothing although work is pending: the request
        at the head of the queue and the limit it cannot get past."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...
