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
* padded attention pairs: the query-key pairs a *dense* attention kernel computes. Gather
  backends (``torch_sdpa``, ``eager``) pad each attention call's sequences to its longest query
  and longest context and run one masked dense attention over ``n x max_query x max_context``
  (the mask hides pairs, it does not skip them), so a prompt of ``q`` rows costs ``q * q`` pairs,
  not ``q (q + 1) / 2``, and eight ragged prompts cost eight times the longest one's square. The
  runner attends a mixed step's runs of decode and prefill sequences separately
  (:func:`attention_runs`): decode runs add nothing here (their keys are the context term),
  each run with a prompt or chunk adds its rectangle. Fused kernels (vLLM's paged attention,
  FlashAttention, ``triton_paged``) compute the causal pairs instead; the cost model uses the
  pairs its hardware says the kernel computes (``Hardware.attention_pairs``).
* shared context tokens: the part of the context tokens read from KV blocks that an earlier
  sequence of the same step also reads (a prefix-cache block shared by several running
  sequences: :func:`shared_context_tokens`). The attention kernel reads it once per sequence,
  but after the first reader of a layer it comes from the CPU's / GPU's cache, not from memory,
  so the cost model prices it apart from the rest of the context.

Computed before the step updates ``num_computed_tokens``.
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from engine.interfaces.scheduler import ScheduledSequence

#: the runner attends a mixed step per run of sequences when it has a run of at least this many
#: decodes (``ModelRunner.min_decode_run``; ``None``: one call for the whole step)
MIN_DECODE_RUN = 2


def attention_runs(query_lens: SequenceOf[int], min_decode_run: int | None = MIN_DECODE_RUN) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges of the step's sequences that share one attention call.

    Consecutive sequences of one kind (single-row decodes, or prompts / chunks) form a run; a
    mixed step is attended per run when a decode run has at least ``min_decode_run`` sequences
    (keeping decodes off the padded path pays then), otherwise in one call over all sequences.
    """
    runs: list[tuple[int, int]] = []
    first = 0
    for index in range(1, len(query_lens) + 1):
        if index == len(query_lens) or (query_lens[index] == 1) != (query_lens[first] == 1):
            runs.append((first, index))
            first = index
    longest_decode_run = max((end - start for start, end in runs if query_lens[start] == 1), default=0)
    if min_decode_run is None or len(runs) <= 1 or longest_decode_run < min_decode_run:
        return [(0, len(query_lens))]
    return runs


def padded_pairs(query_lens: SequenceOf[int], context_lens: SequenceOf[int],
                 min_decode_run: int | None = MIN_DECODE_RUN) -> int:
    """Query-key pairs dense attention computes: ``n * max query * max context`` per call with
    more than one query row (decode-only calls read their context: the context term)."""
    pairs = 0
    for start, end in attention_runs(query_lens, min_decode_run):
        longest_query = max(query_lens[start:end])
        if longest_query > 1:
            pairs += (end - start) * longest_query * max(context_lens[start:end])
    return pairs


def shared_context_tokens(scheduled: SequenceOf[ScheduledSequence], ends: SequenceOf[int], block_size: int) -> int:
    """Context tokens the step's sequences read from full KV blocks that an earlier sequence of
    the step reads too (``ends[i]``: keys of sequence ``i``).

    Only the prefix cache shares blocks, and a shared block lies within the prefix a sequence hit
    (its ``num_cached_tokens``) at the same index in every table (blocks are keyed by their chained
    content), so only the step's longest hit is searched: a step without hits costs one pass
    over its sequences."""
    reach = max((item.seq.num_cached_tokens for item in scheduled), default=0) // block_size
    if reach == 0:
        return 0
    seen: set[int] = set()
    shared = 0
    for item, end in zip(scheduled, ends):
        for block in item.seq.block_table[:min(reach, end // block_size)]:
            if block in seen:
                shared += block_size
            else:
                seen.add(block)
    return shared


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
        padded_attention_pairs: query-key pairs a dense (padded, masked) attention kernel
            computes for the step's calls with more than one query row (:func:`padded_pairs`).
        shared_context_tokens: the part of ``context_tokens`` read from KV blocks an earlier
            sequence of the step also reads (:func:`shared_context_tokens`).
    """

    num_seqs: int
    num_rows: int
    num_decode_tokens: int
    num_wasted_slots: int
    num_sampled: int
    context_tokens: int
    prefill_attention_pairs: int
    padded_attention_pairs: int = 0
    shared_context_tokens: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt rows (and recompute after preemption): everything not decode and not wasted."""
        return self.num_rows - self.num_decode_tokens - self.num_wasted_slots

    @classmethod
    def of(cls, scheduled: SequenceOf[ScheduledSequence], min_decode_run: int | None = MIN_DECODE_RUN,
           block_size: int = 1) -> "StepShape":
        rows = decode = wasted = sampled = context = pairs = 0
        query_lens, ends = [], []
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
            query_lens.append(num_new)
            ends.append(end)
            if num_new > 1:
                pairs += num_new * start + num_new * (num_new + 1) // 2
        padded = padded_pairs(query_lens, ends, min_decode_run) if pairs else 0  # decode-only: no rectangle
        shared = shared_context_tokens(scheduled, ends, block_size)
        return cls(len(scheduled), rows, decode, wasted, sampled, context, pairs, padded, shared)
