"""Per-step metadata to the GPU in one copy per dtype, through reusable pinned host buffers.

Each step the runner builds its metadata on the host (input ids, positions, slot mapping, sampled
rows, query start offsets, query and context lengths, block tables: eight small tensors) and needs
it on the device. Copied one by one from ordinary (pageable) memory, that is eight synchronous
host -> device transfers per step: CUDA first copies pageable memory into a pinned bounce buffer of
its own, and a pageable copy blocks the host until it is done.

:class:`HostStaging` packs the step's tensors of one dtype into one page-locked (pinned) host
buffer, kept from step to step and grown when a step needs more, and sends it as one
``non_blocking`` copy: two transfers per step (int64, int32) that the host queues without waiting.
The device tensors it returns are views of one fresh device tensor per dtype (the caching
allocator makes that cheap), so no step's metadata aliases another's.

A pinned buffer is reused, so the host must not write it while the previous step's copy may still
be reading it: a CUDA event recorded after the copies is waited on before the next fill (by then
the previous step has long finished: its sampled tokens went back to the host).

The runner stages only on CUDA; elsewhere each tensor keeps its plain ``.to(device)``. With
``pin_memory=False`` the same packing runs on any device (the unit tests run it on the CPU).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class HostStaging:
    """Reusable host buffers (one per dtype) and one host -> device copy per dtype per step."""

    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.pin_memory = pin_memory
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None  # recorded after the last step's copies (CUDA only)

    def stage(self, tensors: Sequence[tuple[torch.Tensor, torch.dtype]]) -> list[torch.Tensor]:
        """``[tensor.to(device, dtype) for tensor, dtype in tensors]``, each with its own shape,
        but as one copy per distinct dtype. The host tensors are only read."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous copies have read the buffers we are about to fill
        groups: dict[torch.dtype, list[int]] = {}
        for index, (_, dtype) in enumerate(tensors):
            groups.setdefault(dtype, []).append(index)
        staged: list[torch.Tensor | None] = [None] * len(tensors)
        for dtype, indices in groups.items():
            sizes = [tensors[i][0].numel() for i in indices]
            host = self._buffer(dtype, sum(sizes))
            offset = 0
            for i, size in zip(indices, sizes):
                host[offset : offset + size].copy_(tensors[i][0].reshape(-1))  # converts the dtype
                offset += size
            device = torch.empty(offset, dtype=dtype, device=self.device)
            device.copy_(host[:offset], non_blocking=self.pin_memory)
            for i, part in zip(indices, device.split(sizes)):
                staged[i] = part.view(tensors[i][0].shape)
        if self.pin_memory and self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        return staged  # type: ignore[return-value]  # every slot was filled above

    def _buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The host buffer for ``dtype``, at least ``numel`` long (grown to twice its size or to
        ``numel``, whichever is larger; growing only happens after the previous copy was waited on)."""
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            size = max(numel, 2 * buffer.numel() if buffer is not None else 1024)
            buffer = self.buffers[dtype] = torch.empty(size, dtype=dtype, pin_memory=self.pin_memory)
        return buffer
