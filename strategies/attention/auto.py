"""``attention=auto``: the fastest attention backend that is correct for the run's device and dtype.

vLLM picks its attention backend itself (``vllm/attention/selector.py``: by device, dtype, head
size and what is installed); a user should not have to know the backend's name to get the fast
path. The choice, from measurements in this repository:

* CPU, float32: ``cpu_paged`` (the C kernel that reads the paged cache in place; docs/performance.md
  section 3.4; with the fused ops and skinny GEMM that came with it, decode steps were 1.5x / 1.2x /
  1.3x faster at batch 1 / 8 / 32 than with ``torch_sdpa``, section 7), when
  its kernel compiles; without a C compiler it warns and falls back to ``torch_sdpa``.
* CUDA: ``torch_sdpa``. ``triton_paged`` is the in-place kernel for CUDA, but no GPU result is
  recorded yet (the GPU check, ``python -m experiments.bench.gpu_check``, docs/gpu.md, checks
  ``triton_paged``'s logits against HF; nothing has timed it against ``torch_sdpa`` on a GPU), so
  the measured-safe choice stays; change ``CUDA_CHOICE`` when such a measurement says otherwise.
* Anything else (bfloat16 / float16 on CPU, MPS): ``torch_sdpa``, the backend that runs everywhere.

The backend actually built is recorded in ``summary.json`` (``environment.attention_backend``).
"""
from __future__ import annotations

import warnings

import torch

from engine.device import resolve_device, resolve_dtype
from engine.interfaces.attention import AttentionBackend
from engine.native import NativeKernelUnavailable
from strategies.attention.cpu_paged import CpuPagedBackend
from strategies.attention.torch_sdpa import TorchSDPABackend

CUDA_CHOICE = TorchSDPABackend  # until a GPU measurement of triton_paged against it says otherwise


def preferred_backend(device: torch.device, dtype: torch.dtype) -> type:
    """The backend class ``auto`` builds for this device and dtype (before any fallback)."""
    if device.type == "cpu" and dtype == torch.float32:
        return CpuPagedBackend
    if device.type == "cuda":
        return CUDA_CHOICE
    return TorchSDPABackend


def select_attention_backend(device: str = "auto", dtype: str = "auto") -> AttentionBackend:
    """Build the backend for ``device`` / ``dtype`` (the run's own ``device`` and ``dtype`` strings,
    ``auto`` allowed: resolved exactly as the engine resolves them)."""
    torch_device = resolve_device(device)
    backend_class = preferred_backend(torch_device, resolve_dtype(dtype, torch_device))
    try:
        return backend_class()
    except NativeKernelUnavailable as error:  # cpu_paged compiles its kernel in __init__
        warnings.warn(f"attention=auto: {backend_class.name}'s C kernel is unavailable ({error}); using torch_sdpa", stacklevel=2)
        return TorchSDPABackend()
