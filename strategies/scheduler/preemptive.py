"""Continuous batching that reserves only what the next step needs, and preempts when dry.

Reserving a request's worst case at admission (the continuous scheduler) wastes memory on
tokens that may never be generated. This scheduler grows each sequence one block at a time,
so more sequences fit; the price is that memory can run out mid-flight. Then the *youngest*
running sequence is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed from token 0 (prompt plus what it already generated) when memory
returns. Preempting the youngest means the oldest always progresses — no starvation — and
greedy recompute lands on the identical continuation. (vLLM can also swap K/V to host memory;
recompute is its default for small models, and the only mode here.)
"""
from __future__ import annotations

from engine.sequence import Sequence, SequenceStatus
from engine.interfaces.scheduler import SchedulerOutput
from strategies.scheduler.continuous import ContinuousScheduler


class PreemptiveScheduler(ContinuousScheduler):
    """Same arguments as :class:`ContinuousScheduler`."""

    def admission_reservation(self, seq: Sequence, num_tokens_this_step: int) -> int:
        return num_tokens_this_step

    def make_room(self, seq: Sequence, num_tokens: int, output: SchedulerOutput) -> bool:
        """Grow ``seq``; while memory is short, preempt the youngest running sequence.

        Returns False if ``seq`` itself was the youngest and got preempted.
        """
        while not self.cache.grow(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim, output)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        output.preempted.append(seq)
