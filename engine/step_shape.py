"""The shape of one engine step: how much work the batch the scheduler built asks for.

A step computes ``num_new_tokens`` rows for every scheduled sequence, starting at its
``num_computed_tokens``. Everything a cost model needs follows from those two numbers per
sequence, so the real engine records them with every step (``steps.csv``) and the simulator
prices the very same shape (``simulator/cost_model.py``):

* rows through the linear layers: every new token (prefill, decode, a wasted static slot);
* decode tokens: single next-token rows of sequences that already produced output;
* context tokens: the sum over sequences of the keys each one's last row attends to
  (``start + num_new``), i.e. the KV cache read by attention;
* prefill attention pairs: query-key pairs under the causal mask, ``sum_j (start + j + 1)`` over
  the new rows ``j`` of each sequence computing more than one row (a prompt or a chunk),
  ``num_new * start + num_new * (num_new + 1) / 2``: the quadratic prefill-attention term. A
  single-row step of a sequence (decode) reads its context once: that is the context term, and
  it is left out here so the two kinds of attention (compute-bound prefill, memory-bound decode)
  stay separate terms of the cost.

Computed before the step updates ``num_computed_tokens``.
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from engine.interfaces.scheduler import ScheduledSequence


@dataclass(frozen=True)
class StepShape:
    """Work of one step, summed over its scheduled sequences.

    Attributes:
        num_seqs: scheduled sequences (wasted static slots included).
        num_rows: token rows through the model (prefill + decode + wasted).
        num_decode_tokens: single next-token rows of sequences with output already.
        num_wasted_slots: finished static-batch members recomputing their last token.
        num_sampled: rows whose logits are needed (a sequence's last uncomputed token).
        context_tokens: keys read by attention, summed over sequences.
        prefill_attention_pairs: causal query-key pairs of sequences computing > 1 row this step.
    """

    num_seqs: int
    num_rows: int
    num_decode_tokens: int
    num_wasted_slots: int
    num_sampled: int
    context_tokens: int
    prefill_attention_pairs: int

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt rows (and recompute after preemption): everything not decode and not wasted."""
        return self.num_rows - self.num_decode_tokens - self.num_wasted_slots

    @classmethod
    def of(cls, scheduled: SequenceOf[ScheduledSequence]) -> "StepShape":
        rows = decode = wasted = sampled = context = pairs = 0
        for item in scheduled:  # runs every step: plain attribute reads, no Sequence properties
            seq, num_new, padding = item.seq, item.num_new_tokens, item.is_padding
            num_tokens = len(seq.token_ids)
            # A padding row (finished member of a static batch) recomputes its last token.
            start = num_tokens - 1 if padding else seq.num_computed_tokens
            end = start + num_new
            rows += num_new
            if padding:
                wasted += 1
            elif num_tokens > len(seq.prompt_token_ids) and num_tokens - start == 1:
                decode += 1  # a sequence with output whose one uncomputed token is its last
            if end == num_tokens:
                sampled += 1
            context += end
            if num_new > 1:
                pairs += num_new * start + num_new * (num_new + 1) // 2
        return cls(len(scheduled), rows, decode, wasted, sampled, context, pairs)
