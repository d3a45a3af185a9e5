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
``[B, num_kv_heads, Q * G, head_dim]`` (row ``q * G + g``). One batched matmul over the
``num_kv_heads`` axis then serves all ``G`` query heads from a single copy of each KV head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention_metadata import AttentionMetadata


@dataclass
class GroupedBatch:
    """A step rearranged for dense attention (``G`` = query heads per KV head).

    Attributes:
        query: ``[B, Hkv, Q * G, D]`` grouped, padded queries (``Q = max_query_len``).
        key: ``[B, Hkv, L, D]`` gathered context keys (``L = max_context_len``); padding is 0.
        value: ``[B, Hkv, L, D]`` gathered context values; padding is 0.
        mask: bool, broadcastable to ``[B, 1, Q * G, L]``; True where a row may attend to a key.
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

    ``slot[b, t] = block_tables[b, t // block_size] * block_size + t % block_size``; positions
    ``t >= context_lens[b]`` get a harmless slot (table padding is block 0) and valid=False.
    """
    bs = metadata.block_size
    positions = torch.arange(metadata.max_context_len, device=metadata.block_tables.device)
    blocks = metadata.block_tables.long()[:, positions // bs]
    slots = blocks * bs + positions % bs
    valid = positions[None, :] < metadata.context_lens[:, None]
    return slots, valid


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each sequence's context out of the paged cache: ``(key, value, valid)``.

    key/value are ``[B, Hkv, L, D]`` with padding positions zeroed (stale or uninitialised
    slots may hold NaN, and ``0 * NaN`` would poison the output even under a mask); valid is
    ``[B, L]``.
    """
    # vLLM's fused paged-attention kernel replaces this gather: it reads K/V block by block
    # through the block table inside the kernel, so no [B, Hkv, L, D] copy exists.
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    slots, valid = context_slots(metadata)
    pad = ~valid[:, :, None, None]
    key = k_cache.view(-1, num_kv_heads, head_dim)[slots].masked_fill_(pad, 0)
    value = v_cache.view(-1, num_kv_heads, head_dim)[slots].masked_fill_(pad, 0)
    return key.transpose(1, 2), value.transpose(1, 2), valid


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
        grouped = query.view(num_seqs, num_kv_heads, group, head_dim)
        mask = valid[:, None, None, :]  # [B, 1, 1, L]: broadcasts over the G rows
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
        .permute(0, 2, 1, 3, 4)
        .reshape(num_seqs, num_kv_heads, max_q * group, head_dim)
    )
    first_pos = (metadata.context_lens - metadata.query_lens).long()
    query_pos = first_pos[:, None] + torch.arange(max_q, device=query.device)  # [B, Q]
    key_pos = torch.arange(metadata.max_context_len, device=query.device)
    causal = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
    mask = causal.repeat_interleave(group, dim=1)[:, None]  # [B, 1, Q * G, L]
    return GroupedBatch(grouped, key, value, mask, seq_ids, row_ids)


def ungroup_output(out: torch.Tensor, batch: GroupedBatch, num_heads: int) -> torch.Tensor:
    """Undo :func:`group_step`: ``[B, Hkv, Q * G, D]`` -> flat ``[T, Hq, D]`` (padding dropped)."""
    num_seqs, num_kv_heads, rows, head_dim = out.shape
    if batch.seq_ids is None:
        return out.reshape(num_seqs, num_heads, head_dim)
    group = num_heads // num_kv_heads
    max_q = rows // group
    per_row = (
        out.view(num_seqs, num_kv_heads, max_q, group, head_dim)
        .permute(0, 2, 1, 3, 4)
        .reshape(num_seqs, max_q, num_heads, head_dim)
    )
    return per_row[batch.seq_ids, batch.row_ids]
