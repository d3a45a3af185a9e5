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
(no transpose copy of the gathered context).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention_metadata import AttentionMetadata


@dataclass
class GroupedBatch:
    """A step rearranged for dense attention (``G`` = query heads per KV head).

    Attributes:
        query: ``[Hkv, B, Q * G, D]`` grouped, padded queries (``Q = max_query_len``).
        key: ``[Hkv, B, L, D]`` gathered context keys (``L = max_context_len``).
        value: ``[Hkv, B, L, D]`` gathered context values.
        mask: bool, broadcastable to ``[1, B, Q * G, L]``; True where a row may attend to a key.
        seq_ids: ``[T]`` sequence of every flat query row (None for decode-only steps).
        row_ids: ``[T]`` index of every flat query row inside its sequence (None for decode).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor | None
    row_ids: torch.Tensor | None


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


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each sequence's context out of the paged cache: ``(key, value, valid)``.

    key/value are ``[Hkv, B, L, D]``, contiguous, each built by one ``index_select`` of
    ``head_dim``-long rows (row ``slot * Hkv + kv_head`` of the cache seen as ``[-1, D]``),
    which writes the KV-head-major layout directly; valid is ``[B, L]``.
    """
    # vLLM's fused paged-attention kernel replaces this gather: it reads K/V block by block
    # through the block table inside the kernel, so no [Hkv, B, L, D] copy exists.
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    slots, valid = context_slots(metadata)
    heads = torch.arange(num_kv_heads, device=slots.device)
    rows = (slots[None] * num_kv_heads + heads[:, None, None]).view(-1)
    shape = (num_kv_heads, *slots.shape, head_dim)
    key = k_cache.view(-1, head_dim).index_select(0, rows).view(shape)
    value = v_cache.view(-1, head_dim).index_select(0, rows).view(shape)
    return key, value, valid


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
    key, value, valid = gather_kv(k_cache, v_cache, metadata)
    if metadata.is_decode_only:
        grouped = query.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
        mask = valid[None, :, None, :]  # [1, B, 1, L]: broadcasts over the G rows
        return GroupedBatch(grouped, key, value, mask, None, None)

    max_q = metadata.max_query_len
    seq_ids = torch.repeat_interleave(
        torch.arange(num_seqs, device=query.device), metadata.query_lens.long(), output_size=num_tokens
    )
    row_ids = torch.arange(num_tokens, device=query.device) - metadata.query_start_loc.long()[seq_ids]
    padded = query.new_zeros(num_seqs, max_q, num_heads, head_dim)
    padded[seq_ids, row_ids] = query
    grouped = (
        padded.view(num_seqs, max_q, num_kv_heads, group, head_dim)
        .permute(2, 0, 1, 3, 4)
        .reshape(num_kv_heads, num_seqs, max_q * group, head_dim)
    )
    first_pos = (metadata.context_lens - metadata.query_lens).long()
    query_pos = first_pos[:, None] + torch.arange(max_q, device=query.device)  # [B, Q]
    key_pos = torch.arange(metadata.max_context_len, device=query.device)
    causal = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
    mask = causal.repeat_interleave(group, dim=1)[None]  # [1, B, Q * G, L]
    return GroupedBatch(grouped, key, value, mask, seq_ids, row_ids)


def ungroup_output(out: torch.Tensor, batch: GroupedBatch, num_heads: int) -> torch.Tensor:
    """Undo :func:`group_step`: ``[Hkv, B, Q * G, D]`` -> flat ``[T, Hq, D]`` (padding dropped)."""
    num_kv_heads, num_seqs, rows, head_dim = out.shape
    if batch.seq_ids is None:
        return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)
    group = num_heads // num_kv_heads
    max_q = rows // group
    per_row = (
        out.reshape(num_kv_heads, num_seqs, max_q, group, head_dim)
        .permute(1, 2, 0, 3, 4)
        .reshape(num_seqs, max_q, num_heads, head_dim)
    )
    return per_row[batch.seq_ids, batch.row_ids]
