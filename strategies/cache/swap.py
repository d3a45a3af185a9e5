"""Swap space: a host-memory block pool that holds the K/V of preempted sequences.

When a preemptive scheduler runs out of KV memory it must take blocks from a running sequence.
*Recompute* throws that sequence's K/V away and prefills prompt + generated tokens again when it
resumes: compute grows with the context (quadratically, for attention). *Swap* copies the
sequence's K/V blocks to host memory instead and copies them back, into whichever blocks are
free then, when it resumes: a memory copy that grows linearly with the context (vLLM's
``preemption_mode="swap"``, its ``swap_space`` in GiB; here ``swap_space_tokens``).

The host pool mirrors the device cache block for block: one ``[num_host_blocks, block_size,
kv_heads, head_dim]`` tensor per layer and K/V, pinned when the cache lives on a GPU, and its own
:class:`~strategies.cache.block_pool.BlockPool`. A copy moves only the blocks that hold computed
tokens, batched per layer and tensor (gather on one side, one transfer, scatter on the other;
vLLM's ``swap_blocks`` issues one ``cudaMemcpyAsync`` per block instead). On a GPU every
transfer goes through a pinned staging tensor and is asynchronous: the transfers of all layers
are queued before the one synchronisation, so they overlap each other and the gathers (a
transfer from pageable memory would block at each layer). On CPU the "device"
is host memory too, so a swap is a memory-to-memory copy: cheaper than on a GPU's PCIe link,
still a measured cost. (The CUDA path has not been run on a GPU in this project yet.)

Counters (cumulative; the engine turns them into per-step columns of ``steps.csv``): blocks and
bytes copied out and in, and the seconds spent copying (CUDA copies are synchronised before the
clock stops, so the time is the transfer's, not the launch's).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from strategies.cache.block_pool import BlockPool


@dataclass
class SwappedKV:
    """Where a swapped-out sequence's K/V wait: host blocks for its first ``num_tokens`` tokens."""

    host_blocks: list[int]
    num_tokens: int


@dataclass
class SwapCounters:
    """Cumulative swap traffic."""

    out_blocks: int = 0
    in_blocks: int = 0
    out_bytes: int = 0
    in_bytes: int = 0
    seconds: float = 0.0


class HostSwapSpace:
    """Host copies of K/V blocks, one pool shaped like the device cache.

    Args:
        kv_caches: the device cache's ``(k, v)`` tensors per layer (shapes and dtype are mirrored;
            empty for a cache without tensors).
        num_blocks: host blocks (``swap_space_tokens // block_size``); at least 1.
    """

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.device = kv_caches[0][0].device if kv_caches else torch.device("cpu")
        pin = self.device.type == "cuda"
        self.host_caches = [
            tuple(torch.empty((num_blocks, *cache.shape[1:]), dtype=cache.dtype, pin_memory=pin) for cache in pair)
            for pair in kv_caches
        ]  # none without tensors (a cache driven by the simulator): blocks are counted, nothing is copied
        self.block_bytes = sum(cache[0].numel() * cache.element_size() for pair in kv_caches for cache in pair)
        self.swapped: dict[int, SwappedKV] = {}
        self.counters = SwapCounters()

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def can_hold(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def copy_out(self, seq_id: int, kv_caches, device_blocks: list[int], num_tokens: int) -> None:
        """Copy ``device_blocks`` (a sequence's first blocks) to fresh host blocks; check :meth:`can_hold` first."""
        host_blocks = self.pool.allocate(len(device_blocks))
        self._copy(kv_caches, device_blocks, host_blocks, to_host=True)
        self.swapped[seq_id] = SwappedKV(host_blocks, num_tokens)
        self.counters.out_blocks += len(device_blocks)
        self.counters.out_bytes += len(device_blocks) * self.block_bytes

    def copy_in(self, seq_id: int, kv_caches, device_blocks: list[int], first_block: int) -> None:
        """Copy the sequence's host blocks from logical block ``first_block`` on into ``device_blocks``,
        then release every host block it held (blocks before ``first_block`` came from elsewhere)."""
        entry = self.swapped.pop(seq_id)
        host_blocks = entry.host_blocks[first_block:]
        if host_blocks:
            self._copy(kv_caches, device_blocks, host_blocks, to_host=False)
        self.counters.in_blocks += len(host_blocks)
        self.counters.in_bytes += len(host_blocks) * self.block_bytes
        self.discard_blocks(entry)

    def discard(self, seq_id: int) -> None:
        """Forget a swapped sequence's K/V without copying it back (it finished or was aborted)."""
        self.discard_blocks(self.swapped.pop(seq_id))

    def discard_blocks(self, entry: SwappedKV) -> None:
        for block in entry.host_blocks:
            self.pool.release(block)

    def _copy(self, kv_caches, device_blocks: list[int], host_blocks: list[int], to_host: bool) -> None:
        start = time.perf_counter()
        pin = self.device.type == "cuda"
        device_index = torch.tensor(device_blocks, dtype=torch.int64, device=self.device)
        host_index = torch.tensor(host_blocks, dtype=torch.int64)
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pinned staging, host pool) kept until the sync
        for (k_cache, v_cache), (k_host, v_host) in zip(kv_caches, self.host_caches):
            for cache, host in ((k_cache, k_host), (v_cache, v_host)):
                stage = torch.empty((len(host_blocks), *host.shape[1:]), dtype=host.dtype, pin_memory=pin)
                if to_host:
                    stage.copy_(cache.index_select(0, device_index), non_blocking=pin)
                else:
                    torch.index_select(host, 0, host_index, out=stage)
                    cache.index_copy_(0, device_index, stage.to(self.device, non_blocking=pin))
                staged.append((stage, host))
        if pin:
            torch.cuda.synchronize(self.device)
        if to_host:
            for stage, host in staged:
                host.index_copy_(0, host_index, stage)
        self.counters.seconds += time.perf_counter() - start
