"""What an attention backend does, and the one thing every backend shares: the KV write.

A backend receives the new tokens' query/key/value of one layer, writes the new K/V into the
paged cache at ``slot_mapping`` and returns attention of every query row over its whole
context, reading earlier tokens through the sequence's block table. The cache tensors have
shape ``[num_blocks, block_size, num_kv_heads, head_dim]``; physical slot ``s`` is
``cache.view(-1, num_kv_heads, head_dim)[s]``.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from engine.attention_metadata import AttentionMetadata


@runtime_checkable
class AttentionBackend(Protocol):
    """Computes paged attention for one layer.

    ``forward`` shapes: query ``[T, num_heads, head_dim]``, key/value
    ``[T, num_kv_heads, head_dim]``, caches ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    returns ``[T, num_heads, head_dim]`` in the query's dtype. ``num_heads`` is a multiple of
    ``num_kv_heads`` (grouped-query attention): query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    ``attention_pairs`` says which query-key pairs the backend computes, for the simulator's cost
    model (:mod:`engine.step_shape`): ``"causal"`` (a fused kernel that skips masked keys) or
    ``"padded"`` (dense attention over each call's sequences padded to its longest query and
    context, the mask hiding pairs without skipping them).

    Optional: a backend whose work is one C kernel may offer ``native_attention(metadata,
    model_config, kv_cache_dtype)`` -> :class:`engine.native_layers.NativeAttention`, so that decoder layers can
    run in one C call each (``cpu_paged`` and ``cpu_paged_cascade`` do); without it every step
    takes the Python layer path.
    """

    name: str
    attention_pairs: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' K/V into their physical slots (one indexed copy per tensor).

    vLLM replaces this with the fused ``reshape_and_cache`` CUDA kernel.
    """
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
