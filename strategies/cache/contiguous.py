"""The contiguous KV cache: one region per sequence, reserved up front — ``malloc`` of the maximum.

This is how serving systems worked before paging (FasterTransformer, early TGI, naive
``generate()``): when a request is admitted, it gets one contiguous region large enough for the
longest sequence it *might* become, and keeps it until it finishes. Two reservation policies:

* ``reserve="max_model_len"``: every region holds ``max_model_len`` tokens, whatever the
  request (the allocator cannot know how long the output will be);
* ``reserve="request"``: the region holds the request's own worst case, prompt + max_tokens.

Both waste memory in the three ways the vLLM paper measures: *reserved* slots for tokens not
generated yet, *internal fragmentation* (slots never used because the request stops early or
is shorter than the region), and *external fragmentation*: regions come from a first-fit
allocator over one flat arena, so after some frees the free memory is split into holes and a
request can be refused although enough slots are free in total. ``stats()`` shows the first two
(used tokens vs reserved tokens); ``pool.largest_free_extent`` shows the third.

Representation: the arena is ``capacity_tokens // block_size`` blocks and a region is a run of
consecutive blocks, so ``seq.block_table = [start, start + 1, ...]`` and the runner's universal
slot formula ``block_table[t // B] * B + t % B`` addresses it unchanged. The region granularity
``block_size`` (default 16) is deliberately not 1: the block table stays short
(``max_model_len / 16`` entries per sequence and step), a fused paged kernel reads 16-token
tiles rather than single tokens, and contiguous vs paged at the same ``block_size`` differ only
in the allocation policy. Rounding a region up to whole blocks costs under ``block_size`` slots
per sequence — nothing next to the reservation itself. (A gather backend computes one slot per
context position either way, so its cost does not depend on the block size.)
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Literal

from engine.sequence import Sequence
from strategies.cache.paged import PagedCache

ReservePolicy = Literal["max_model_len", "request"]
RESERVE_POLICIES: tuple[ReservePolicy, ...] = ("max_model_len", "request")


class FirstFitArena:
    """A flat arena of ``num_blocks`` blocks handing out runs of consecutive blocks, first fit.

    Free memory is a list of extents ``(start, length)``, sorted by start and coalesced: freeing
    a region merges it with free neighbours. ``allocate`` takes the lowest-addressed extent that
    is long enough, so holes left by early finishers are reused when a request fits in them.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"an arena needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_extents: list[tuple[int, int]] = [(0, num_blocks)]
        self.num_free = num_blocks

    @property
    def largest_free_extent(self) -> int:
        """The longest region that can be handed out now (< ``num_free`` when fragmented)."""
        return max((length for _, length in self.free_extents), default=0)

    def allocate(self, length: int) -> int | None:
        """Start block of a free run of ``length`` blocks, or ``None`` if no hole is long enough."""
        if length < 1:
            raise ValueError(f"a region needs at least 1 block, got {length}")
        for index, (start, free_length) in enumerate(self.free_extents):
            if free_length >= length:
                if free_length == length:
                    del self.free_extents[index]
                else:
                    self.free_extents[index] = (start + length, free_length - length)
                self.num_free -= length
                return start
        return None

    def release(self, start: int, length: int) -> None:
        """Return a region; raises ``RuntimeError`` if any of its blocks is already free."""
        end = start + length
        if start < 0 or end > self.num_blocks or length < 1:
            raise RuntimeError(f"region [{start}, {end}) is outside the arena of {self.num_blocks} blocks")
        index = bisect_left(self.free_extents, (start,))
        before = self.free_extents[index - 1] if index > 0 else None
        after = self.free_extents[index] if index < len(self.free_extents) else None
        if (before and before[0] + before[1] > start) or (after and after[0] < end):
            raise RuntimeError(f"double free: region [{start}, {end}) overlaps free memory")
        if after and after[0] == end:
            end += after[1]
            del self.free_extents[index]
        if before and before[0] + before[1] == start:
            start = before[0]
            index -= 1
            del self.free_extents[index]
        self.free_extents.insert(index, (start, end - start))
        self.num_free += length

    def check_all_free(self) -> None:
        """Assert the arena is whole again: one free extent covering every block."""
        if self.free_extents != [(0, self.num_blocks)]:
            raise AssertionError(f"leak: {self.num_blocks - self.num_free} blocks not free, free extents {self.free_extents[:8]}")


class ContiguousCache(PagedCache):
    """Naive KV cache: each admitted sequence reserves one contiguous region for its lifetime.

    It is a paged cache whose allocator hands out one run of consecutive blocks per sequence,
    sized at admission and never grown: tensors, block tables and stats are the paged cache's.

    Args:
        capacity_tokens: KV budget in tokens; the arena has ``capacity_tokens // block_size`` blocks.
        reserve: ``"max_model_len"`` (every region holds ``max_model_len`` tokens) or
            ``"request"`` (a region holds the request's prompt + max_tokens).
        max_model_len: region size for ``reserve="max_model_len"``. ``None`` takes the model's
            limit from :meth:`bind_model_limits`, which the engine calls; an explicit value wins.
        block_size: region granularity in tokens (regions are whole runs of blocks).
        gpu_memory_utilization: see :class:`~strategies.cache.paged.PagedCache`.
    """

    def __init__(
        self,
        capacity_tokens: int = 16384,
        reserve: ReservePolicy = "max_model_len",
        max_model_len: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        if reserve not in RESERVE_POLICIES:
            raise ValueError(f"reserve must be one of {RESERVE_POLICIES}, got {reserve!r}")
        super().__init__(block_size=block_size, capacity_tokens=capacity_tokens,
                         gpu_memory_utilization=gpu_memory_utilization)
        self.pool = FirstFitArena(self.num_blocks)  # replaces the paged free list
        self.reserve = reserve
        self.max_model_len: int | None = None
        if max_model_len is not None:
            self.bind_model_limits(max_model_len)

    def bind_model_limits(self, max_model_len: int) -> None:
        """Learn the model's longest sequence. Keeps a ``max_model_len`` given to the constructor.

        Raises ``ValueError`` when ``reserve="max_model_len"`` and one region does not fit.
        """
        if self.max_model_len is None:
            if max_model_len < 1:
                raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
            self.max_model_len = max_model_len
        if self.reserve == "max_model_len" and self.blocks_for(self.max_model_len) > self.num_blocks:
            raise ValueError(
                f"contiguous cache: capacity_tokens ({self.num_blocks * self.block_size} usable) cannot hold one region of "
                f"max_model_len ({self.max_model_len}) tokens; raise cache.capacity_tokens, lower "
                f"cache.max_model_len, or use reserve=request"
            )

    def bound_max_model_len(self) -> int:
        if self.max_model_len is None:
            raise RuntimeError("reserve='max_model_len' needs max_model_len: pass it or call bind_model_limits()")
        return self.max_model_len

    def region_tokens(self, seq: Sequence) -> int:
        """Tokens reserved for ``seq`` at admission (before rounding up to whole blocks)."""
        return seq.max_total_tokens if self.reserve == "request" else self.bound_max_model_len()

    def max_tokens_per_seq(self) -> int:
        return super().max_tokens_per_seq() if self.reserve == "request" else self.bound_max_model_len()

    def allocate_for(self, seq: Sequence, num_tokens: int) -> bool:
        """Reserve ``seq``'s whole region now; ``num_tokens`` only has to fit inside it."""
        region_tokens = self.region_tokens(seq)
        if num_tokens > region_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} needs {num_tokens} tokens, more than its {self.reserve} region of {region_tokens}"
            )
        length = self.blocks_for(region_tokens)
        start = self.pool.allocate(length)
        if start is None:
            return False
        seq.block_table = list(range(start, start + length))
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        self.live_seqs[seq.seq_id] = seq
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """True within the region; a contiguous region cannot grow in place."""
        return num_tokens <= len(seq.block_table) * self.block_size

    def release_blocks(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table[0], len(seq.block_table))
