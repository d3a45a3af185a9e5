"""Continuous (iteration-level) batching, as introduced by Orca.

The batch is re-decided every step: running sequences each get their next token (or their next
prefill chunk), then waiting requests are admitted while a slot (``max_num_seqs``), the token
budget (``max_num_batched_tokens``) and KV memory allow. A sequence that finishes leaves in the
same step and its memory is reused by the next admission. This scheduler reserves a request's
worst case (prompt + max_tokens) at admission, so a running sequence never runs out of memory;
:mod:`strategies.scheduler.preemptive` reserves less and preempts instead.
"""
from __future__ import annotations

from collections import deque

from engine.sequence import Sequence, SequenceStatus
from engine.interfaces.cache import KVCacheStrategy
from engine.interfaces.scheduler import ScheduledSequence, SchedulerInvariantError, SchedulerOutput
from strategies.scheduler.policy import SchedulingPolicy


class ContinuousScheduler:
    """Iteration-level scheduler with worst-case reservation at admission.

    Args:
        cache: the KV-cache strategy that hands out memory.
        max_model_len: longest sequence (prompt + output) the model accepts.
        max_num_seqs: most sequences running at once (batch slots).
        max_num_batched_tokens: most tokens computed in one step; ``None`` means
            ``max_model_len`` (any valid prompt fits in one step).
        chunked_prefill: split prompts longer than the remaining token budget across steps,
            so decode tokens and prefill chunks share one forward pass.
        policy: who is admitted (and preempted) first: ``"fcfs"``, ``"priority"`` or ``"sjf"``
            (:mod:`strategies.scheduler.policy`).
        sjf_aging_steps: ``sjf`` only: steps a request may wait before it is aged into the FCFS
            lane ahead of every unaged request (the anti-starvation bound).
    """

    def __init__(
        self,
        cache: KVCacheStrategy,
        max_model_len: int,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int | None = None,
        chunked_prefill: bool = False,
        policy: str = "fcfs",
        sjf_aging_steps: int = 64,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.policy = SchedulingPolicy(policy, sjf_aging_steps)
        self.cache = cache
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or max_model_len
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order (fcfs), else policy rank at the step's start
        self.num_steps = 0  # schedule() calls so far: the policy's clock (sjf aging)
        self.arrival_steps: dict[int, int] = {}  # seq_id -> num_steps when it was added

    # -- queue -----------------------------------------------------------------------------
    def max_tokens_in_one_step(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The most tokens this request may ever need computed in one step without chunked
        prefill: its prompt (worst-case reservation means it is never preempted)."""
        return num_prompt_tokens

    def validate_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Without chunked prefill a request's prefill is one step: it must fit the token budget."""
        if self.chunked_prefill:
            return
        needed = self.max_tokens_in_one_step(num_prompt_tokens, max_tokens)
        if needed > self.max_num_batched_tokens:
            raise ValueError(
                f"request needs up to {needed} tokens computed in one step "
                f"({self.one_step_need_reason(num_prompt_tokens, max_tokens)}) but max_num_batched_tokens="
                f"{self.max_num_batched_tokens} and chunked_prefill is off; raise max_num_batched_tokens or "
                f"enable chunked_prefill"
            )

    def one_step_need_reason(self, num_prompt_tokens: int, max_tokens: int) -> str:
        return f"its prompt of {num_prompt_tokens} tokens"

    def add(self, seq: Sequence) -> None:
        self.validate_request(seq.num_prompt_tokens, seq.sampling_params.max_tokens)
        seq.status = SequenceStatus.WAITING
        self.arrival_steps[seq.seq_id] = self.num_steps
        self.waiting.append(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- policy hooks (overridden by the preemptive scheduler) --------------------------------
    def admission_reservation(self, seq: Sequence, num_tokens_this_step: int) -> int:
        """Tokens to reserve when admitting ``seq``: its worst case, so it never runs dry."""
        return seq.max_total_tokens

    def make_room(self, seq: Sequence, num_tokens: int, output: SchedulerOutput) -> bool:
        """Ensure ``seq`` can hold ``num_tokens``; the reservation made at admission guarantees it."""
        if not self.cache.grow(seq, num_tokens):
            raise RuntimeError(f"sequence {seq.seq_id} ran out of its reserved KV memory")
        return True

    def apply_policy(self) -> None:
        """Start a step: order the queue and the running set by the policy's rank (best first).

        Running sequences then get the token budget in rank order, and the last running
        sequence is the preemption victim; admission serves the queue in rank order.
        """
        self.num_steps += 1
        if self.policy.reorders:
            self.running = self.policy.order(self.running, self.arrival_steps, self.num_steps)
            self.waiting = deque(self.policy.order(self.waiting, self.arrival_steps, self.num_steps))

    def forget(self, seq: Sequence) -> None:
        """Drop the policy's bookkeeping of a sequence that left the scheduler."""
        self.arrival_steps.pop(seq.seq_id, None)

    # -- the step decision -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.apply_policy()
        output = SchedulerOutput()
        token_budget = self.max_num_batched_tokens
        self.schedule_running(output, token_budget - output.num_batched_tokens)
        if not output.preempted:
            self.admit_waiting(output, self.max_num_batched_tokens - output.num_batched_tokens)
        output.num_waiting = len(self.waiting)
        self.check_invariants(output)
        return output

    def schedule_running(self, output: SchedulerOutput, token_budget: int) -> None:
        """In running order (policy rank; oldest first under fcfs): each running sequence gets its
        next token or its next prefill chunk."""
        index = 0
        while index < len(self.running) and token_budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, token_budget)
            if num_new < seq.num_uncomputed_tokens and not self.chunked_prefill:
                break
            if self.make_room(seq, seq.num_computed_tokens + num_new, output):
                output.scheduled.append(ScheduledSequence(seq, num_new))
                token_budget -= num_new
                index += 1
            # else: make_room preempted ``seq`` itself, which left ``self.running``.

    def admit_waiting(self, output: SchedulerOutput, token_budget: int) -> None:
        """In queue (policy) order: stop at the first request that does not fit."""
        while self.waiting and len(self.running) < self.max_num_seqs and token_budget > 0:
            seq = self.waiting[0]
            num_cached = self.cache.num_cached_prefix_tokens(seq)
            num_new = seq.num_tokens - num_cached
            if num_new > token_budget:
                if not self.chunked_prefill:
                    break
                num_new = token_budget
            if not self.cache.admit(seq, self.admission_reservation(seq, num_cached + num_new)):
                break
            if seq.num_computed_tokens != num_cached:
                raise SchedulerInvariantError(
                    f"cache applied a prefix hit of {seq.num_computed_tokens} tokens to sequence {seq.seq_id} "
                    f"but reported {num_cached}"
                )
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            output.scheduled.append(ScheduledSequence(seq, num_new))
            token_budget -= num_new

    def retire(self, finished: list[Sequence]) -> None:
        for seq in finished:
            self.running.remove(seq)
            self.cache.free(seq)
            self.forget(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq)
        else:  # waiting or preempted: it holds no memory
            self.waiting.remove(seq)
        self.forget(seq)

    # -- liveness ---------------------------------------------------------------------------
    def explain_stall(self) -> str:
        """Why nothing was scheduled although work is pending (see ``SchedulerStalled``)."""
        if not self.waiting:
            return f"{len(self.running)} running sequences, none could be scheduled (token budget {self.max_num_batched_tokens})"
        seq = self.waiting[0]
        num_cached = self.cache.num_cached_prefix_tokens(seq)
        num_new = seq.num_tokens - num_cached
        who = (f"request {seq.seq_id} ({seq.status.value}: prompt {seq.num_prompt_tokens} + "
               f"{seq.num_output_tokens} generated tokens, {num_cached} cached)")
        if not self.chunked_prefill and num_new > self.max_num_batched_tokens:
            return (f"{who} needs {num_new} tokens computed in one step but max_num_batched_tokens="
                    f"{self.max_num_batched_tokens} and chunked_prefill is off")
        if len(self.running) >= self.max_num_seqs:
            return f"{who} waits for a slot: max_num_seqs={self.max_num_seqs} running"
        reservation = self.admission_reservation(seq, num_cached + min(num_new, self.max_num_batched_tokens))
        stats = self.cache.stats()
        return (f"{who} needs KV memory for {reservation} tokens but the cache has {stats.num_free_blocks} of "
                f"{stats.num_blocks} blocks of {self.cache.block_size} tokens free, with {len(self.running)} "
                f"sequences running")

    # -- invariants (checked at the end of every schedule(), like vLLM; raised, never asserted) --
    def check_invariants(self, output: SchedulerOutput) -> None:
        if len(self.running) > self.max_num_seqs:
            raise SchedulerInvariantError(f"{len(self.running)} running sequences for {self.max_num_seqs} slots")
        if output.num_batched_tokens > self.max_num_batched_tokens:
            raise SchedulerInvariantError(
                f"{output.num_batched_tokens} tokens scheduled over the budget of {self.max_num_batched_tokens}"
            )
        scheduled_ids = [item.seq.seq_id for item in output.scheduled]
        if len(scheduled_ids) != len(set(scheduled_ids)):
            raise SchedulerInvariantError(f"a sequence is scheduled twice in {scheduled_ids}")
        block_size = self.cache.block_size
        for item in output.scheduled:
            seq = item.seq
            expected = SequenceStatus.FINISHED if item.is_padding else SequenceStatus.RUNNING
            if seq.status is not expected:
                raise SchedulerInvariantError(f"scheduled sequence {seq.seq_id} is {seq.status}, expected {expected}")
            end = seq.num_tokens if item.is_padding else seq.num_computed_tokens + item.num_new_tokens
            if item.num_new_tokens <= 0 or end > seq.num_tokens:
                raise SchedulerInvariantError(
                    f"sequence {seq.seq_id} scheduled {item.num_new_tokens} tokens up to {end} of its {seq.num_tokens}"
                )
            if end > len(seq.block_table) * block_size:
                raise SchedulerInvariantError(
                    f"sequence {seq.seq_id} has KV room for {len(seq.block_table) * block_size} tokens, needs {end}"
                )
        for seq in output.preempted:
            if seq.seq_id in scheduled_ids or seq.block_table:
                raise SchedulerInvariantError(f"preempted sequence {seq.seq_id} is scheduled or kept its memory")
