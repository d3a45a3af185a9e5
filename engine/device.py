"""Device and dtype selection: ``auto`` picks CUDA, then Apple MPS, then the CPU.

A CUDA device is held with its index (``cuda:1``), and every thread that runs the engine makes
it current (:func:`activate`): Triton launches, CUDA graph capture and ``torch.cuda`` memory
counters act on the current device, which is device 0 in a new thread whatever the engine's
tensors use.
"""
from __future__ import annotations

import contextlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """``auto``, ``cpu``, ``mps``, ``cuda`` or ``cuda:N`` as a device; a CUDA device always carries
    its index (``cuda`` is the current device), checked against the devices present.

    Raises ``ValueError`` for a string torch does not parse, CUDA where there is none, or an index
    past ``torch.cuda.device_count()``."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"unknown device {name!r} (auto, cpu, mps, cuda or cuda:N): {error}") from None
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"device {name!r}: no CUDA device is available")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ValueError(f"device {name!r}: CUDA device index {index} but only {count} device(s) (0-{count - 1})")
    return torch.device("cuda", index)


def activate(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (``torch.cuda.set_device``), so
    that whatever launches on "the current device" (Triton kernels, graph capture, streams,
    ``torch.cuda`` memory counters) uses it. Each thread that runs the engine calls it; a no-op
    off CUDA."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``with on_device(tensor.device):`` makes a CUDA tensor's device current for a launch; a
    no-op context elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 elsewhere (CPU bf16 eager is slower for small batches)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]
