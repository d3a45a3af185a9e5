"""Automatic prefix caching: the paged cache, plus sharing of full blocks between sequences.

Many requests start with the same tokens (a system prompt, a few-shot preamble, the earlier
turns of a chat). Their K/V for those tokens are identical, so they can be computed once and
shared — a prefix hit skips that part of the prefill.

**Hash chain.** Only *full* blocks are shared, and a block's K/V depend on every token before
it, not just its own. So a block is identified by its whole prefix, built as a chain: the key of
block ``i`` is ``(key of block i - 1, token ids of block i)``. Looking a prompt up means walking
its blocks from the first: hit, hit, hit, ... until the first miss. Here the parent link is the
parent entry's id, a number never reused, and the table is a dict keyed by ``(parent id, token
ids)``: Python hashes that key and, on a hash match, compares the stored token ids, so a hash
collision can never return another prefix's K/V, and a parent that was evicted and
re-published gets a new id, which orphans its stale children.

**Reference counts.** A shared block is held by several sequences at once; the pool counts
them. Freeing a sequence drops one reference per block.

**LRU of freed cached blocks.** A block whose count drops to 0 still holds valid K/V for its
prefix. Instead of returning it to the free list it is *parked* in an LRU list, still findable
by its key and counted as free memory. A later prefix hit revives it (out of the LRU, count 1);
when a fresh block is needed and the free list is empty, the least recently parked block is
evicted: its key is forgotten and the block reused. A sequence's blocks are released tail first
(see ``PagedCache.free``), so a chain is evicted from its end and its useful start survives.

The last, partially filled block of a sequence is private; once computation fills it, it is
published (``on_tokens_computed``) and becomes shareable.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

from engine.sequence import Sequence
from engine.interfaces.cache import CacheStats
from strategies.cache.block_pool import BlockPool
from strategies.cache.paged import PagedCache

#: parent id of a sequence's first block
ROOT_ID = 0

BlockKey = tuple[int, tuple[int, ...]]  # (parent entry id, token ids of the block)


@dataclass(frozen=True)
class CachedBlock:
    """A published full block: its entry id (the parent link of its children) and physical block."""

    entry_id: int
    block: int


class CachingBlockPool(BlockPool):
    """A :class:`BlockPool` that keeps unreferenced published blocks reusable until evicted.

    ``num_free`` counts the free list plus the parked (evictable) blocks; ``allocate`` evicts
    least-recently-parked blocks when the free list alone is too short.
    """

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.cached: dict[BlockKey, CachedBlock] = {}
        self.key_of_block: dict[int, BlockKey] = {}
        self.parked: OrderedDict[int, None] = OrderedDict()  # least recently parked first
        self.entry_ids = count(ROOT_ID + 1)
        self.num_evicted = 0  # cumulative evictions of parked cached blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.parked)

    def lookup(self, parent_id: int, token_ids: tuple[int, ...]) -> CachedBlock | None:
        return self.cached.get((parent_id, token_ids))

    def publish(self, block: int, parent_id: int, token_ids: tuple[int, ...]) -> int:
        """Make ``block`` findable under its prefix; returns the entry id of that prefix.

        If the prefix is already cached (another sequence computed the same tokens at the same
        time), the existing entry stays and ``block`` remains private to its sequence.
        """
        key = (parent_id, token_ids)
        existing = self.cached.get(key)
        if existing is not None:
            return existing.entry_id
        entry = CachedBlock(next(self.entry_ids), block)
        self.cached[key] = entry
        self.key_of_block[block] = key
        return entry.entry_id

    def acquire(self, block: int) -> None:
        """Share a held block, or revive a parked one (it leaves the LRU)."""
        self.parked.pop(block, None)
        super().acquire(block)

    def release(self, block: int, keep: bool = False) -> bool:
        """Drop one reference; an unreferenced published block is parked instead of freed."""
        published = block in self.key_of_block
        unreferenced = super().release(block, keep=keep or published)
        if unreferenced and published:
            self.parked[block] = None
        return unreferenced

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks, evicting the least recently parked cached blocks if the free list is short."""
        if num_blocks > self.num_free:
            raise RuntimeError(f"block pool exhausted: asked for {num_blocks}, {self.num_free} free")
        while len(self.free_blocks) < num_blocks:
            victim, _ = self.parked.popitem(last=False)
            del self.cached[self.key_of_block.pop(victim)]
            self.give_back(victim)
            self.num_evicted += 1
        return super().allocate(num_blocks)

    def check_all_free(self) -> None:
        """Assert nothing is referenced and every block is free or parked (parked blocks are free memory)."""
        if self.num_free != self.num_blocks or any(self.ref_counts):
            held = [b for b, refs in enumerate(self.ref_counts) if refs]
            raise AssertionError(f"leak: {self.num_blocks - self.num_free} blocks not free, held: {held[:16]}")


class PrefixCache(PagedCache):
    """Paged KV cache with automatic prefix caching (vLLM's APC).

    Args:
        block_size: tokens per block; also the sharing granularity (only full blocks are shared).
        capacity_tokens: KV budget in tokens; the pool has ``capacity_tokens // block_size`` blocks.
        gpu_memory_utilization: see :class:`~strategies.cache.paged.PagedCache`.
    """

    shares_blocks = True  # stats() counts a shared block once

    def __init__(self, block_size: int = 16, capacity_tokens: int = 16384, gpu_memory_utilization: float = 0.9) -> None:
        super().__init__(block_size=block_size, capacity_tokens=capacity_tokens,
                         gpu_memory_utilization=gpu_memory_utilization)
        self.pool: CachingBlockPool = CachingBlockPool(self.num_blocks)  # replaces the plain pool
        # entry ids of each live sequence's full, computed blocks: the chain it publishes onto
        self.chains: dict[int, list[int]] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    def block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])

    def match_prefix(self, seq: Sequence) -> list[CachedBlock]:
        """Cached blocks of ``seq``'s longest cached prefix, leaving at least one token to compute."""
        hits: list[CachedBlock] = []
        parent_id = ROOT_ID
        for index in range((seq.num_tokens - 1) // self.block_size):
            entry = self.pool.lookup(parent_id, self.block_tokens(seq, index))
            if entry is None:
                break
            hits.append(entry)
            parent_id = entry.entry_id
        return hits

    def num_prefix_hit_tokens(self, seq: Sequence) -> int:
        return len(self.match_prefix(seq)) * self.block_size

    def allocate_for(self, seq: Sequence, num_tokens: int) -> bool:
        """Share the cached prefix of ``seq`` and allocate fresh blocks for the rest of ``num_tokens``."""
        hits = self.match_prefix(seq)
        num_revived = sum(1 for entry in hits if self.pool.ref_counts[entry.block] == 0)
        num_fresh = self.blocks_for(num_tokens) - len(hits)
        if num_fresh > self.pool.num_free - num_revived:  # revived blocks stop counting as free
            return False
        for entry in hits:
            self.pool.acquire(entry.block)
        seq.block_table = [entry.block for entry in hits]
        self.grow(seq, num_tokens)  # cannot fail: room was checked above
        hit_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = hit_tokens
        seq.num_cached_tokens = hit_tokens
        self.live_seqs[seq.seq_id] = seq
        self.chains[seq.seq_id] = [entry.entry_id for entry in hits]
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += hit_tokens
        return True

    def on_tokens_computed(self, seq: Sequence) -> None:
        """Publish every block that the last step completed."""
        chain = self.chains[seq.seq_id]
        for index in range(len(chain), seq.num_computed_tokens // self.block_size):
            parent_id = chain[-1] if chain else ROOT_ID
            chain.append(self.pool.publish(seq.block_table[index], parent_id, self.block_tokens(seq, index)))

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self.chains.pop(seq.seq_id, None)  # absent for a swapped-out sequence

    def stats(self) -> CacheStats:
        return dataclasses.replace(
            super().stats(), prefix_hit_tokens=self.prefix_hit_tokens, prefix_query_tokens=self.prefix_query_tokens,
            prefix_evicted_blocks=self.pool.num_evicted,
        )
