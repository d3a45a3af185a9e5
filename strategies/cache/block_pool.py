"""The physical block allocator behind the paged caches: a free list plus reference counts.

Blocks are page frames. ``allocate`` pops frames off the free list with reference count 1;
``release`` drops one reference and returns the frame to the free list when nobody holds it.
Sharing (the prefix cache) is ``acquire`` on a block someone else already holds. Releasing a
block nobody holds raises, so a double free can never silently corrupt another sequence.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    """``num_blocks`` frames, each with a reference count; free frames sit in a FIFO list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` free frames (reference count 1). All or nothing."""
        if num_blocks > len(self.free_blocks):
            raise RuntimeError(f"block pool exhausted: asked for {num_blocks}, {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def acquire(self, block: int) -> None:
        """Add a reference to a block that is held, or revive one parked outside the free list."""
        self.ref_counts[block] += 1

    def release(self, block: int, keep: bool = False) -> bool:
        """Drop one reference. Returns True when the block is now unreferenced.

        An unreferenced block goes back to the free list, unless ``keep``: then the caller parks
        it (the prefix cache keeps it reusable in an LRU) and later calls :meth:`give_back`.
        """
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"double free: block {block} has no references")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] > 0:
            return False
        if not keep:
            self.free_blocks.append(block)
        return True

    def give_back(self, block: int) -> None:
        """Return an unreferenced block the caller parked (an evicted cached block) to the free list."""
        if self.ref_counts[block] != 0:
            raise RuntimeError(f"block {block} still has {self.ref_counts[block]} references")
        self.free_blocks.append(block)

    def check_all_free(self) -> None:
        """Assert the pool is whole: every block free and unreferenced (used by tests and at shutdown)."""
        if len(self.free_blocks) != self.num_blocks or any(self.ref_counts):
            held = [b for b, count in enumerate(self.ref_counts) if count]
            raise AssertionError(f"leak: {self.num_blocks - len(self.free_blocks)} blocks not free, held: {held[:16]}")
