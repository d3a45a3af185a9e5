"""Packed shared prefixes kept across decode steps, and the rule that says when one is stale.

The cascade kernel (``csrc/cascade_attention.c``) reads a group's shared prefix from a packed
copy: per KV head, K transposed into key tiles, then V rows side by side. Copying it out of the
paged cache is a DRAM-bound read of the whole prefix (30 layers x 0.76 MB at a 500-token prompt
on SmolLM2: ~1.7 ms of a one-thread decode step). In decode the same group holds the same
prefix blocks step after step, so the copy is made once per (layer, blocks) and kept.

When is a kept copy stale? Only when K/V in one of its blocks changes, and the cache changes
only through

1. a forward pass writing the step's new K/V at ``slot_mapping`` (every forward of the model
   runs through the attention backend, which calls :meth:`PackedPrefixes.forget_written` first):
   the prefill of a new prompt into a block that was freed or evicted and handed out again under
   the same id, or recompute after preemption;
2. torch in-place writes to the cache tensors (swap-in copies blocks back with ``index_copy_``),
   which bump the tensor's version counter; a copy is tied to the cache tensor objects (weak
   references) and their versions, so a new cache at the same address or a torch write also
   makes it stale.

While a block is shared it is never written: a prefix cache shares full blocks only, and a
sequence writes into its own last block (``plan_groups`` counts only full blocks strictly before
every member's query token). So in steady decode nothing is invalidated, and an evicted block
that comes back with other content drops every copy that includes it in the step that writes it.

Memory: copies are kept least-recently-used first out under ``budget_bytes``. One prefix of
``n`` tokens costs ``layers x 2 x kv_heads x ceil16(n) x head_dim x 4`` bytes (SmolLM2-135M, 500
tokens: 30 x 0.79 MB = 23.6 MB). A copy larger than the whole budget is packed into a buffer used
for this call only (the round-1 behaviour: repacked every step).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class _Copy:
    caches: tuple[weakref.ref, weakref.ref]
    versions: tuple[int, int]
    blocks: frozenset[int]
    data: torch.Tensor


def _versions(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    return k_cache._version, v_cache._version


class PackedPrefixes:
    """Kept packed copies, keyed by (layer's K cache tensor, the group's prefix block ids)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._copies: OrderedDict[tuple[int, tuple[int, ...]], _Copy] = OrderedDict()
        self._bytes = 0

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def forget_written(self, slot_mapping: torch.Tensor, block_size: int) -> int:
        """Drop every copy of a block that this forward writes into; returns how many were dropped."""
        if not self._copies:
            return 0
        written = set((slot_mapping // block_size).tolist())
        stale = [key for key, copy in self._copies.items() if not copy.blocks.isdisjoint(written)]
        for key in stale:
            self._drop(key)
        return len(stale)

    def buffer(self, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: tuple[int, ...],
               floats: int) -> tuple[torch.Tensor, bool]:
        """The packed buffer of ``blocks`` in this layer's caches, and whether the kernel must pack it
        (False: a kept copy of the same K/V)."""
        key = (id(k_cache), blocks)
        copy = self._copies.get(key)
        if copy is not None:
            if (copy.caches[0]() is k_cache and copy.caches[1]() is v_cache
                    and copy.versions == _versions(k_cache, v_cache)):
                self._copies.move_to_end(key)
                return copy.data, False
            self._drop(key)
        data = torch.empty(floats)
        size = data.numel() * data.element_size()
        if size > self.budget_bytes:
            return data, True
        while self._bytes + size > self.budget_bytes:
            self._drop(next(iter(self._copies)))
        self._copies[key] = _Copy((weakref.ref(k_cache), weakref.ref(v_cache)), _versions(k_cache, v_cache),
                                  frozenset(blocks), data)
        self._bytes += size
        return data, True

    def _drop(self, key: tuple[int, tuple[int, ...]]) -> None:
        copy = self._copies.pop(key)
        self._bytes -= copy.data.numel() * copy.data.element_size()
