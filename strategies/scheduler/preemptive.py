"""Continuous batching that reserves only what the next step needs, and preempts when dry.

Reserving a request's worst case at admission (the continuous scheduler) wastes memory on
tokens that may never be generated. This scheduler grows each sequence one block at a time,
so more sequences fit; the price is that memory can run out mid-flight. Then the worst-ranked
running sequence is preempted — under ``policy=fcfs`` the *youngest*, so the oldest always
progresses (no starvation); under ``priority`` / ``sjf`` the policy's last
(:mod:`strategies.scheduler.policy`). The victim goes back to the queue, and what happens to
its K/V is the ``preemption_mode``:

* ``recompute`` (vLLM's default): its blocks are freed; when memory returns it is prefilled
  again from token 0 (prompt plus what it already generated). Greedy recompute lands on the
  identical continuation. Cost: compute that grows with the context.
* ``swap``: its computed blocks are copied to a host-memory pool of ``swap_space_tokens``
  (:mod:`strategies.cache.swap`) and copied back into fresh blocks on resume, which then
  continues where it stopped. Cost: two memory copies that grow linearly with the context.
  When the host pool is full the victim falls back to recompute.
"""
from __future__ import annotations

from engine.interfaces.cache import KVCacheStrategy, SwappableCache
from engine.interfaces.scheduler import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from strategies.scheduler.continuous import ContinuousScheduler

PREEMPTION_MODES = ("recompute", "swap")


class PreemptiveScheduler(ContinuousScheduler):
    """:class:`ContinuousScheduler`'s arguments, plus:

    Liveness: without chunked prefill a preempted sequence may be recomputed in one step (swap
    falls back to recompute when the host pool is full), prompt plus every token it generated,
    so a request is accepted only if prompt + max_tokens - 1 (the most it can hold when
    preempted before its last token) fits ``max_num_batched_tokens``.

    Args:
        preemption_mode: ``"recompute"`` or ``"swap"``.
        swap_space_tokens: ``swap`` only: host-memory pool size in tokens (rounded down to whole
            blocks); it must hold the longest sequence the cache can hold, or a single victim could
            never be swapped.
    """

    def __init__(
        self,
        cache: KVCacheStrategy,
        max_model_len: int,
        *args,
        preemption_mode: str = "recompute",
        swap_space_tokens: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(cache, max_model_len, *args, **kwargs)
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption_mode {preemption_mode!r}; supported: {', '.join(PREEMPTION_MODES)}")
        self.preemption_mode = preemption_mode
        if preemption_mode == "swap":
            self.enable_swap(swap_space_tokens)

    def enable_swap(self, swap_space_tokens: int) -> None:
        if not isinstance(self.cache, SwappableCache):
            raise ValueError(f"preemption_mode=swap needs a cache with swap support; {type(self.cache).__name__} has none")
        longest = min(self.max_model_len, self.cache.max_tokens_per_seq())
        usable = swap_space_tokens // self.cache.block_size * self.cache.block_size
        if usable < longest:
            raise ValueError(
                f"swap_space_tokens={swap_space_tokens} ({usable} usable in blocks of {self.cache.block_size}) cannot "
                f"hold even one sequence of up to {longest} tokens (min(max_model_len, the cache's per-sequence limit)); "
                f"raise scheduler.swap_space_tokens to at least {longest}"
            )
        self.cache.enable_swap(swap_space_tokens)

    def max_tokens_in_one_step(self, num_prompt_tokens: int, max_tokens: int) -> int:
        return num_prompt_tokens + max_tokens - 1

    def one_step_need_reason(self, num_prompt_tokens: int, max_tokens: int) -> str:
        return (f"after a preemption its prompt of {num_prompt_tokens} tokens plus up to {max_tokens - 1} "
                f"generated tokens (max_tokens={max_tokens}) are recomputed in one step")

    def admission_reservation(self, seq: Sequence, num_tokens_this_step: int) -> int:
        return num_tokens_this_step

    def make_room(self, seq: Sequence, num_tokens: int, output: SchedulerOutput) -> bool:
        """Grow ``seq``; while memory is short, preempt the worst-ranked (last) running sequence.

        Returns False if ``seq`` itself was the last and got preempted.
        """
        while not self.cache.grow(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim, output)
            if victim is seq:
                return False
        return True

    def abort(self, seq: Sequence) -> None:
        """Also drops a swapped-out copy of an aborted preempted sequence."""
        swapped = self.preemption_mode == "swap" and seq not in self.running and self.cache.is_swapped_out(seq)
        super().abort(seq)
        if swapped:
            self.cache.free(seq)

    def preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self.running.remove(seq)
        swapped = self.preemption_mode == "swap" and self.cache.swap_out(seq)
        if not swapped:  # recompute (or the host pool is full): drop the K/V
            self.cache.free(seq)
            seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        output.preempted.append(seq)
