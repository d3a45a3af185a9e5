"""The paged KV cache: fixed-size blocks from a free list, one block table per sequence.

Like virtual memory, a sequence sees a contiguous run of token positions while its K/V sit in
scattered physical blocks; its block table is the page table. A sequence grows one block at a
time, so at most ``block_size - 1`` slots of its last block are ever wasted, and every block
returns to the free list the moment its sequence finishes.
"""
from __future__ import annotations

import torch

from engine.sequence import Sequence
from engine.interfaces.cache import CacheStats, allocate_kv_tensors
from strategies.cache.block_pool import BlockPool


class PagedCache:
    """Paged KV cache (vLLM's PagedAttention memory manager).

    Args:
        block_size: tokens per block.
        capacity_tokens: KV budget in tokens; the pool has ``capacity_tokens // block_size`` blocks.
    """

    def __init__(self, block_size: int = 16, capacity_tokens: int = 16384) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity_tokens < block_size:
            raise ValueError(f"capacity_tokens ({capacity_tokens}) must hold at least one block of {block_size} tokens")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self.pool = BlockPool(self.num_blocks)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.live_seqs: dict[int, Sequence] = {}

    def allocate_tensors(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.kv_caches = allocate_kv_tensors(
            num_layers, self.num_blocks, self.block_size, num_kv_heads, head_dim, dtype, device
        )

    def bind_model_limits(self, max_model_len: int) -> None:
        return None  # blocks are handed out on demand: no per-sequence region to size

    def max_tokens_per_seq(self) -> int:
        return self.num_blocks * self.block_size

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        return 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} is admitted while holding blocks {seq.block_table}")
        if not self.grow(seq, num_tokens):
            return False
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        self.live_seqs[seq.seq_id] = seq
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(missing))
        return True

    def free(self, seq: Sequence) -> None:
        if self.live_seqs.pop(seq.seq_id, None) is None:
            raise RuntimeError(f"double free: sequence {seq.seq_id} holds no KV blocks")
        for block in reversed(seq.block_table):  # tail first: a prefix cache then evicts chains from their end
            self.pool.release(block)
        seq.block_table = []

    def on_tokens_computed(self, seq: Sequence) -> None:
        return None

    #: whether two live sequences can hold the same block (the prefix cache); without sharing,
    #: stats() sums per sequence instead of walking every block (it runs once per engine step)
    shares_blocks = False

    def stats(self) -> CacheStats:
        if self.shares_blocks:
            used, reserved = used_and_reserved_tokens(self.live_seqs.values(), self.block_size)
        else:
            used, reserved = private_used_and_reserved_tokens(self.live_seqs.values(), self.block_size)
        return CacheStats(
            used_tokens=used,
            reserved_tokens=reserved,
            capacity_tokens=self.num_blocks * self.block_size,
            num_free_blocks=self.pool.num_free,
            num_blocks=self.num_blocks,
        )


def used_and_reserved_tokens(seqs, block_size: int) -> tuple[int, int]:
    """Distinct slots holding computed K/V, and distinct slots handed out, over live sequences.

    A block shared by several sequences (prefix sharing) counts once, with its fullest fill.
    """
    filled_per_block: dict[int, int] = {}
    for seq in seqs:
        computed = seq.num_computed_tokens
        for index, block in enumerate(seq.block_table):
            filled = min(max(computed - index * block_size, 0), block_size)
            if filled > filled_per_block.get(block, -1):
                filled_per_block[block] = filled
    return sum(filled_per_block.values()), len(filled_per_block) * block_size


def private_used_and_reserved_tokens(seqs, block_size: int) -> tuple[int, int]:
    """:func:`used_and_reserved_tokens` for sequences that share no block: per sequence, the
    computed tokens its blocks hold and the slots of its blocks."""
    used = reserved = 0
    for seq in seqs:
        slots = len(seq.block_table) * block_size
        used += min(seq.num_computed_tokens, slots)
        reserved += slots
    return used, reserved
