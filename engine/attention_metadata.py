"""The per-step batch description that every attention backend reads.

The runner flattens one engine step into a single varlen batch: the new tokens of every
scheduled sequence are concatenated into ``T`` rows. Sequence ``i`` owns rows
``query_start_loc[i] : query_start_loc[i + 1]``; its new tokens sit at the *end* of its
context, i.e. query row ``j`` of sequence ``i`` is at position
``context_lens[i] - query_lens[i] + j`` and attends causally to positions ``<=`` that.
Metadata is passed explicitly to the model and the backend — there is no hidden global context.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, TypeVar

import torch

T = TypeVar("T")


@dataclass
class AttentionMetadata:
    """Tensors describing one flattened step (all on the model's device).

    Attributes:
        query_start_loc: ``[B + 1]`` int32, prefix sums of ``query_lens``.
        query_lens: ``[B]`` int32, new tokens computed this step per sequence.
        context_lens: ``[B]`` int32, tokens in the context *after* this step's tokens are
            written (= num_computed_tokens + query_len).
        slot_mapping: ``[T]`` int64, physical KV slot (``block * block_size + offset``)
            where each new token's K/V is written.
        block_tables: ``[B, max_blocks]`` int32, each sequence's block table, padded with 0
            (padding entries are never read: context_lens bounds every read).
        block_size: tokens per block of the KV tensors.
        max_query_len: ``max(query_lens)`` as a Python int.
        max_context_len: ``max(context_lens)`` as a Python int.
        step_cache: per-step scratch for backends (see :meth:`cached`); starts empty, is not
            part of equality or ``repr``, and dies with the metadata at the end of the step.
    """

    query_start_loc: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int
    max_context_len: int
    step_cache: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()`` once per step, then the same object for every later call with ``key``.

        For what a backend derives from the metadata alone and would otherwise recompute in
        every layer (the gather's slot indices and masks: 30 times per step on SmolLM2).
        ``key`` must name everything ``build`` depends on beyond this metadata (head counts,
        device, dtype). Never store layer data (K/V, queries) here.
        """
        try:
            return self.step_cache[key]
        except KeyError:
            value = self.step_cache[key] = build()
            return value

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
