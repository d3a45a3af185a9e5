"""Static batching: the naive ``generate()`` pattern, kept as the baseline to beat.

A batch of up to ``max_num_seqs`` waiting requests is admitted only when the engine is idle.
Nobody joins until every member has finished, and a member that finishes early keeps its slot
and keeps computing — ``generate()`` runs every row until the longest one is done. Here such a
member recomputes its last token each step (the result is discarded): a *wasted slot*, counted
in the step records. Its memory is freed only when the whole batch ends.
"""
from __future__ import annotations

from engine.sequence import Sequence
from engine.interfaces.scheduler import ScheduledSequence, SchedulerOutput
from strategies.scheduler.continuous import ContinuousScheduler


class StaticScheduler(ContinuousScheduler):
    """Same arguments as :class:`ContinuousScheduler`; each member reserves its worst case."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.finished_members: list[Sequence] = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.finished_members)

    def schedule(self) -> SchedulerOutput:
        self.apply_policy()
        output = SchedulerOutput()
        if not self.running and not self.finished_members:
            self.admit_waiting(output, self.max_num_batched_tokens)
        else:
            self.schedule_running(output, self.max_num_batched_tokens)
            output.scheduled.extend(ScheduledSequence(seq, 1, is_padding=True) for seq in self.finished_members)
        output.num_waiting = len(self.waiting)
        self.check_invariants(output)
        return output

    def retire(self, finished: list[Sequence]) -> None:
        for seq in finished:
            self.running.remove(seq)
            self.finished_members.append(seq)
        self.end_batch_if_done()

    def abort(self, seq: Sequence) -> None:
        """An aborted member leaves the batch at once (nothing of it is left to compute)."""
        super().abort(seq)
        self.end_batch_if_done()

    def end_batch_if_done(self) -> None:
        if not self.running:
            for seq in self.finished_members:
                self.cache.free(seq)
                self.forget(seq)
            self.finished_members = []
