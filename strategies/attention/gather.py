"""Gather-then-attend helpers shared by the ``torch_sdpa`` and ``eager`` backends.

A *gather* backend turns the paged cache back into ordinary dense tensors before attending:
every sequence's context is copied through its block table into one padded
``[B, num_kv_heads, max_context_len, head_dim]`` tensor per layer, and the ragged queries
are padded into ``[B, ..., max_query_len, ...]``. Any dense attention routine can then run on
the padded batch under a mask. The price is that copy (per layer, per step, proportional to
the *whole* context, not to the new tokens) plus the padding of ragged batches. A fused paged
kernel (vLLM's ``paged_attention``, our ``triton_paged``) instead reads K/V *in place* through
the block table and never materialises the gathered tensor.

Grouped-query attention without copying KV heads: query head ``h = kv * G + g`` (``G`` query
heads per KV head) is moved onto the KV head it shares, giving grouped queries of shape
``[num_kv_heads, B, Q * G, head_dim]`` (row ``q * G + g``). One batched matmul over the
``(num_kv_heads, B)`` axes then serves all ``G`` query heads from a single copy of each KV head.
The KV-head axis leads so that the gather writes K/V directly in the layout the matmuls read
(no transpose copy of the gathered context). Decode-only steps (one query row per sequence)
use the batch-major layout instead: queries ``[B, Hkv, G, D]`` are then a free view of the flat
``[B, Hq, D]`` rows, and the output views straight back (no copy of either).

Everything derived from the metadata alone (the slot index of every gathered row, the masks,
the padding layout) is a :class:`StepLayout`, built by the first layer of a step and reused
by the other layers through :meth:`AttentionMetadata.cached`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention_metadata import AttentionMetadata


@dataclass
class StepLayout:
    """The metadata-only part of a gather step, computed once per step and shared by all layers.

    Attributes:
        rows: flat ``index_select`` indices into the cache seen as ``[-1, head_dim]`` (row
            ``slot * Hkv + kv_head``), in the gathered tensor's order.
        shape: shape of the gathered K/V without ``head_dim``: ``(B, Hkv, L)`` for decode-only
            steps, ``(Hkv, B, L)`` otherwise.
        mask: bool, True where a query row may attend to a key; ``[B, 1, 1, L]`` for
            decode-only steps, ``[1, B, Q * G, L]`` otherwise.
        seq_ids / row_ids: ``[T]`` sequence of every flat query row and its index inside the
            sequence (None for decode-only steps).
    """

    rows: torch.Tensor
    shape: tuple[int, int, int]
    mask: torch.Tensor
    seq_ids: torch.Tensor | None
    row_ids: torch.Tensor | None
    _additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as ``0 / -inf`` in ``dtype`` (built once per step and dtype): what SDPA turns
        a bool mask into on every call, and what a decode matmul adds to its scores."""
        if dtype not in self._additive:
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._additive[dtype] = bias.masked_fill_(~self.mask, float("-inf"))
        return self._additive[dtype]


@dataclass
class GroupedBatch:
    """A step rearranged for dense attention (``G`` = query heads per KV head).

    Attributes:
        query: grouped queries: ``[B, Hkv, G, D]`` (a view) for decode-only steps, else
            ``[Hkv, B, Q * G, D]`` padded (``Q = max_query_len``).
        key: gathered context keys, ``[B, Hkv, L, D]`` for decode-only steps, else
            ``[Hkv, B, L, D]`` (``L = max_context_len``).
        value: gathered context values, same layout as ``key``.
        layout: the step's :class:`StepLayout` (mask, row ids), shared by every layer.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    layout: StepLayout

    @property
    def mask(self) -> torch.Tensor:
        """Bool, broadcastable to the scores; True where a row may attend to a key."""
        return self.layout.mask


def context_slots(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical slot of every context position, ``[B, L]`` int64, and its validity mask.

    ``slot[b, t] = block_tables[b, t // block_size] * block_size + t % block_size`` for
    ``t < context_lens[b]``. Padding positions point at the sequence's own first token: real,
    finite data, so a masked-out score never meets stale or uninitialised slots (``0 * NaN``
    would poison the output even under a mask) and no clean-up pass over the gathered copy
    is needed.
    """
    bs = metadata.block_size
    positions = torch.arange(metadata.max_context_len, device=metadata.block_tables.device)
    slots = metadata.block_tables.long()[:, positions // bs] * bs + positions % bs
    valid = positions[None, :] < metadata.context_lens[:, None]
    return torch.where(valid, slots, slots[:, :1]), valid


def build_layout(metadata: AttentionMetadata, num_heads: int, num_kv_heads: int) -> StepLayout:
    """Compute a step's :class:`StepLayout` (use :func:`step_layout`, which caches it)."""
    slots, valid = context_slots(metadata)
    device = slots.device
    heads = torch.arange(num_kv_heads, device=device)
    num_seqs = metadata.num_seqs
    if metadata.is_decode_only:
        rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]  # [B, Hkv, L]
        return StepLayout(rows.view(-1), tuple(rows.shape), valid[:, None, None, :], None, None)

    rows = slots[None] * num_kv_heads + heads[:, None, None]  # [Hkv, B, L]
    group = num_heads // num_kv_heads
    max_q = metadata.max_query_len
    num_tokens = int(metadata.slot_mapping.shape[0])
    seq_ids = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), metadata.query_lens.long(), output_size=num_tokens
    )
    row_ids = torch.arange(num_tokens, device=device) - metadata.query_start_loc.long()[seq_ids]
    first_pos = (metadata.context_lens - metadata.query_lens).long()
    query_pos = first_pos[:, None] + torch.arange(max_q, device=device)  # [B, Q]
    key_pos = torch.arange(metadata.max_context_len, device=device)
    causal = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
    mask = causal.repeat_interleave(group, dim=1)[None]  # [1, B, Q * G, L]
    return StepLayout(rows.view(-1), tuple(rows.shape), mask, seq_ids, row_ids)


def step_layout(metadata: AttentionMetadata, num_heads: int, num_kv_heads: int) -> StepLayout:
    """The step's :class:`StepLayout`, built by the first layer that asks and reused by the rest."""
    key = ("gather.layout", num_heads, num_kv_heads, metadata.block_tables.device)
    return metadata.cached(key, lambda: build_layout(metadata, num_heads, num_kv_heads))


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, layout: StepLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each sequence's context out of the paged cache: ``(key, value)`` in ``layout.shape + (D,)``.

    Each is one ``index_select`` of ``head_dim``-long rows (row ``slot * Hkv + kv_head`` of the
    cache seen as ``[-1, D]``), which writes the attention layout directly.
    """
    # vLLM's fused paged-attention kernel replaces this gather: it reads K/V block by block
    # through the block table inside the kernel, so no gathered copy exists.
    head_dim = k_cache.shape[-1]
    shape = (*layout.shape, head_dim)
    key = k_cache.view(-1, head_dim).index_select(0, layout.rows).view(shape)
    value = v_cache.view(-1, head_dim).index_select(0, layout.rows).view(shape)
    return key, value


def group_step(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata
) -> GroupedBatch:
    """Gather the context and pad + group the flat queries ``[T, Hq, D]`` of one step.

    Decode-only steps (one row per sequence, ``T == B``) need no padding: grouping is a view.
    Otherwise row ``j`` of sequence ``b`` sits at position ``context_lens[b] - query_lens[b] + j``
    and may attend to keys at positions ``<=`` it (padded rows attend to position 0 only
    onwards, stay finite, and are dropped by :func:`ungroup_output`).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    num_seqs = metadata.num_seqs
    layout = step_layout(metadata, num_heads, num_kv_heads)
    key, value = gather_kv(k_cache, v_cache, layout)
    if layout.seq_ids is None:
        grouped = query.view(num_seqs, num_kv_heads, group, head_dim)
        return GroupedBatch(grouped, key, value, layout)

    max_q = metadata.max_query_len
    padded = query.new_zeros(num_seqs, max_q, num_heads, head_dim)
    padded[layout.seq_ids, layout.row_ids] = query
    grouped = (
        padded.view(num_seqs, max_q, num_kv_heads, group, head_dim)
        .permute(2, 0, 1, 3, 4)
        .reshape(num_kv_heads, num_seqs, max_q * group, head_dim)
    )
    return GroupedBatch(grouped, key, value, layout)


def ungroup_output(out: torch.Tensor, batch: GroupedBatch, num_heads: int) -> torch.Tensor:
    """Undo :func:`group_step`: grouped output (same layout as ``batch.query``) -> flat ``[T, Hq, D]``."""
    layout = batch.layout
    if layout.seq_ids is None:  # [B, Hkv, G, D]
        num_seqs, head_dim = out.shape[0], out.shape[-1]
        return out.reshape(num_seqs, num_heads, head_dim)
    num_kv_heads, num_seqs, rows, head_dim = out.shape
    group = num_heads // num_kv_heads
    max_q = rows // group
    per_row = (
        out.reshape(num_kv_heads, num_seqs, max_q, group, head_dim)
        .permute(1, 2, 0, 3, 4)
        .reshape(num_seqs, max_q, num_heads, head_dim)
    )
    return per_row[layout.seq_ids, layout.row_ids]

