"""What a KV-cache strategy is: a memory allocator plus the K/V tensors it hands out.

Think of the cache as an operating system's physical memory. K/V live in fixed *blocks*
(page frames) of ``block_size`` token slots; every sequence keeps a *block table* (its page
table) mapping logical token ``t`` to physical slot
``block_table[t // block_size] * block_size + t % block_size``. Strategies differ only in how
they hand out blocks:

* ``contiguous`` reserves one region per sequence up front (the naive baseline),
* ``paged`` grows a sequence one block at a time from a free list,
* ``prefix`` is paged plus sharing of full blocks between prompts with the same prefix.

All strategies size their tensors once, from one budget (``capacity_tokens``), so they
compete on the same memory. All operations are all-or-nothing: a call that returns ``False``
changed nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from engine.sequence import Sequence


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of KV memory, in tokens.

    Attributes:
        used_tokens: slots holding K/V of live sequences (computed tokens; a shared block counts once).
        reserved_tokens: slots handed to live sequences, used or not (>= used_tokens).
        capacity_tokens: all slots the tensors hold (num_blocks * block_size).
        num_free_blocks: blocks that can be handed out now (including evictable cached blocks).
        num_blocks: blocks in the pool.
        prefix_hit_tokens: cumulative tokens whose prefill was skipped thanks to a prefix hit.
        prefix_query_tokens: cumulative tokens looked up in the prefix cache.
        prefix_evicted_blocks: cumulative cached blocks evicted (their prefix forgotten) to make room.
        swap_used_blocks: host swap-space blocks holding preempted sequences' K/V now.
        swap_out_blocks / swap_in_blocks: cumulative blocks copied to / back from the swap space.
        swap_out_bytes / swap_in_bytes: the same in bytes (K and V of every layer).
        swap_time_s: cumulative seconds spent copying.
    """

    used_tokens: int
    reserved_tokens: int
    capacity_tokens: int
    num_free_blocks: int
    num_blocks: int
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_evicted_blocks: int = 0
    swap_used_blocks: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_time_s: float = 0.0


@runtime_checkable
class KVCacheStrategy(Protocol):
    """The interface schedulers and the runner use. One implementation per file."""

    block_size: int
    num_blocks: int
    #: one ``(k_cache, v_cache)`` pair per layer, ``[num_blocks, block_size, kv_heads, head_dim]``.
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]

    def allocate_tensors(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Create the K/V tensors once; called by the engine after the model is known."""

    def bind_model_limits(self, max_model_len: int) -> None:
        """Learn the model's longest context before any request (contiguous regions are sized by it)."""

    def max_tokens_per_seq(self) -> int:
        """The longest sequence this cache could ever hold (an empty pool, one sequence)."""

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that ``admit`` would not need to compute now: a prefix hit, or K/V it
        swapped out (see :class:`SwappableCache`); 0 otherwise. No side effects."""

    def admit(self, seq: Sequence, num_tokens: int) -> bool:
        """Give a new (or preempted) ``seq`` room for its first ``num_tokens`` tokens.

        Applies prefix hits and swaps swapped-out K/V back in: sets ``seq.num_computed_tokens``
        (to :meth:`num_cached_prefix_tokens`) and ``seq.num_cached_tokens``.
        Returns ``False`` (changing nothing) when memory is short.
        """

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq``'s block table cover ``num_tokens`` tokens. ``False`` if memory is short."""

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks, or drop its swapped-out copy. ``RuntimeError`` if it holds neither."""

    def on_tokens_computed(self, seq: Sequence) -> None:
        """Called after each step that computed tokens of ``seq`` (prefix caches publish full blocks)."""

    def stats(self) -> CacheStats:
        """Current memory usage."""


@runtime_checkable
class SwappableCache(KVCacheStrategy, Protocol):
    """A cache that can park a preempted sequence's K/V in host memory (``preemption_mode=swap``).

    A swapped-out sequence holds no device blocks; its next ``admit`` copies the K/V back into
    fresh blocks and ``num_cached_prefix_tokens`` reports those tokens; ``free`` drops the copy.
    """

    def enable_swap(self, swap_space_tokens: int) -> None:
        """Create the host pool (after ``allocate_tensors``). ``ValueError`` if it holds no block."""

    def swap_out(self, seq: Sequence) -> bool:
        """Copy ``seq``'s computed K/V to the host pool and free its device blocks.
        ``False`` (nothing changed) when the host pool is too full: recompute instead."""

    def is_swapped_out(self, seq: Sequence) -> bool:
        """Whether ``seq``'s K/V wait in the host pool (``free`` drops them)."""


def allocate_kv_tensors(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed ``(k_cache, v_cache)`` pair per layer, ``[num_blocks, block_size, kv_heads, head_dim]``.

    Sized once from the budget; no strategy ever reallocates them.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
