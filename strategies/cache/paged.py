"""The paged KV cache: fixed-size blocks from a free list, one block table per sequence.

Like virtual memory, a sequence sees a contiguous run of token positions while its K/V sit in
scattered physical blocks; its block table is the page table. A sequence grows one block at a
time, so at most ``block_size - 1`` slots of its last block are ever wasted, and every block
returns to the free list the moment its sequence finishes.

Swap (for ``preemption_mode=swap``, :mod:`strategies.cache.swap`) is implemented here once for
every cache built on this class (paged, prefix, contiguous): :meth:`swap_out` copies a
sequence's computed blocks to a host pool and frees them; the next :meth:`admit` of that
sequence allocates blocks the usual way (a prefix cache may share some again) and copies the
rest back, so a resumed sequence skips everything it had computed.
"""
from __future__ import annotations

import torch

from engine.sequence import Sequence
from engine.interfaces.cache import CacheStats, allocate_kv_tensors
from strategies.cache.block_pool import BlockPool
from strategies.cache.swap import HostSwapSpace, SwappedKV


class PagedCache:
    """Paged KV cache (vLLM's PagedAttention memory manager).

    Args:
        block_size: tokens per block.
        capacity_tokens: KV budget in tokens; the pool has ``capacity_tokens // block_size`` blocks.
            ``"auto"`` is resolved by the engine from the GPU's memory before the cache is built
            (:mod:`engine.gpu_memory`); the cache itself only takes a number.
        gpu_memory_utilization: with ``capacity_tokens: auto``, the fraction of the GPU's memory
            the engine may use (weights, activations and KV cache together); read by the engine.
    """

    def __init__(self, block_size: int = 16, capacity_tokens: int = 16384, gpu_memory_utilization: float = 0.9) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not isinstance(capacity_tokens, int):
            raise ValueError(f"capacity_tokens must be a number of tokens here, got {capacity_tokens!r} "
                             f"('auto' is resolved by the engine on a CUDA device, engine/gpu_memory.py)")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.gpu_memory_utilization = gpu_memory_utilization
        if capacity_tokens < block_size:
            raise ValueError(f"capacity_tokens ({capacity_tokens}) must hold at least one block of {block_size} tokens")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self.pool = BlockPool(self.num_blocks)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.live_seqs: dict[int, Sequence] = {}
        self.swap_space: HostSwapSpace | None = None  # set by enable_swap()

    def allocate_tensors(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.kv_caches = allocate_kv_tensors(
            num_layers, self.num_blocks, self.block_size, num_kv_heads, head_dim, dtype, device
        )
        if self.swap_space is not None:  # swap was enabled first (the engine builds the scheduler before the tensors)
            self.swap_space = HostSwapSpace(self.kv_caches, self.swap_space.pool.num_blocks)

    def bind_model_limits(self, max_model_len: int) -> None:
        return None  # blocks are handed out on demand: no per-sequence region to size

    def max_tokens_per_seq(self) -> int:
        return self.num_blocks * self.block_size

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens ``admit`` would restore without computing: a prefix hit or swapped-out K/V."""
        swapped = self.swapped_kv(seq)
        return max(self.num_prefix_hit_tokens(seq), swapped.num_tokens if swapped else 0)

    def num_prefix_hit_tokens(self, seq: Sequence) -> int:
        return 0  # no sharing here (see PrefixCache)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit(self, seq: Sequence, num_tokens: int) -> bool:
        """Room for ``seq``'s first ``num_tokens`` tokens; a swapped-out ``seq`` gets its K/V back."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} is admitted while holding blocks {seq.block_table}")
        swapped = self.swapped_kv(seq)
        if swapped is None:
            return self.allocate_for(seq, num_tokens)
        return self.swap_in(seq, max(num_tokens, swapped.num_tokens), swapped)

    def allocate_for(self, seq: Sequence, num_tokens: int) -> bool:
        """Admission proper: blocks for ``num_tokens`` tokens of a sequence holding none."""
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
        """Return ``seq``'s blocks, or drop its swapped-out copy. Raises on a double free."""
        if self.live_seqs.pop(seq.seq_id, None) is None:
            if self.swapped_kv(seq) is None:
                raise RuntimeError(f"double free: sequence {seq.seq_id} holds no KV blocks")
            self.swap_space.discard(seq.seq_id)
            return
        self.release_blocks(seq)
        seq.block_table = []

    def release_blocks(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # tail first: a prefix cache then evicts chains from their end
            self.pool.release(block)

    # -- swap (preemption_mode=swap) ----------------------------------------------------------
    def enable_swap(self, swap_space_tokens: int) -> None:
        """Create the host pool: ``swap_space_tokens // block_size`` blocks, shaped like the K/V tensors
        (now, or when ``allocate_tensors`` creates them; without tensors, e.g. in the simulator,
        swapping is block bookkeeping only)."""
        num_blocks = swap_space_tokens // self.block_size
        if num_blocks < 1:
            raise ValueError(
                f"swap_space_tokens ({swap_space_tokens}) must hold at least one block of {self.block_size} tokens"
            )
        self.swap_space = HostSwapSpace(self.kv_caches, num_blocks)

    def is_swapped_out(self, seq: Sequence) -> bool:
        return self.swapped_kv(seq) is not None

    def swapped_kv(self, seq: Sequence) -> SwappedKV | None:
        return None if self.swap_space is None else self.swap_space.swapped.get(seq.seq_id)

    def swap_out(self, seq: Sequence) -> bool:
        """Copy ``seq``'s computed blocks to host memory and free its device blocks.

        Returns False (changing nothing) when swap is off, nothing is computed, or the host
        pool is too full: the caller then recomputes instead. ``seq.num_computed_tokens``
        becomes 0 (nothing of it is on the device); ``admit`` restores it.
        """
        num_tokens = seq.num_computed_tokens
        num_blocks = self.blocks_for(num_tokens)
        if self.swap_space is None or num_tokens == 0 or not self.swap_space.can_hold(num_blocks):
            return False
        self.swap_space.copy_out(seq.seq_id, self.kv_caches, seq.block_table[:num_blocks], num_tokens)
        self.free(seq)
        seq.num_computed_tokens = 0
        return True

    def swap_in(self, seq: Sequence, num_tokens: int, swapped: SwappedKV) -> bool:
        """Allocate room for ``num_tokens`` and copy the swapped blocks back (all or nothing).

        Blocks that the allocation already filled (prefix hits) are not copied.
        """
        if not self.allocate_for(seq, num_tokens):
            return False
        first = seq.num_computed_tokens // self.block_size
        last = self.blocks_for(swapped.num_tokens)
        self.swap_space.copy_in(seq.seq_id, self.kv_caches, seq.block_table[first:last], first)
        seq.num_computed_tokens = max(seq.num_computed_tokens, swapped.num_tokens)
        return True

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
        swap = self.swap_space
        return CacheStats(
            used_tokens=used,
            reserved_tokens=reserved,
            capacity_tokens=self.num_blocks * self.block_size,
            num_free_blocks=self.pool.num_free,
            num_blocks=self.num_blocks,
            swap_used_blocks=swap.num_used_blocks if swap else 0,
            swap_out_blocks=swap.counters.out_blocks if swap else 0,
            swap_in_blocks=swap.counters.in_blocks if swap else 0,
            swap_out_bytes=swap.counters.out_bytes if swap else 0,
            swap_in_bytes=swap.counters.in_bytes if swap else 0,
            swap_time_s=swap.counters.seconds if swap else 0.0,
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
