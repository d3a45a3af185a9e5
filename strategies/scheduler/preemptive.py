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
    """Same arguments as :class:`ContinuousScheduler`.

    Liveness: without chunked prefill a preempted sequence is recomputed in one step, prompt plus
    every token it generated, so a request is accepted only if prompt + max_tokens - 1 (the most
    it can hold when preempted before its last token) fits ``max_num_batched_tokens``.
    """

    def max_tokens_in_one_step(self, num_prompt_tokens: int, max_tokens: int) -> int:
        return num_prompt_tokens + max_tokens - 1

    def one_step_need_reason(self, num_prompt_tokens: int, max_tokens: int) -> str:
        return (f"after a preemption its prompt of {num_prompt_tokens} tokens plus up to {max_tokens - 1} "
                f"generated tokens (max_tokens={max_tokens}) are recomputed in one step")

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
