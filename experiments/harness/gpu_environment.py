"""The GPU a run used, recorded in ``summary.json`` beside the CPU, so a GPU result can be traced to
its hardware and software stack.

Three versions matter and they are different things:

- ``torch_cuda``: the CUDA toolkit torch was *built* with (``torch.version.cuda``, e.g. ``"12.4"``);
  ``None`` for a CPU-only build of torch.
- ``cuda_driver_api``: the newest CUDA version the installed *driver* supports (what
  ``cudaDriverGetVersion`` reports, e.g. ``"12.6"``); torch's build must not be newer.
- ``driver``: the NVIDIA kernel driver's own version (e.g. ``"560.35.03"``), read through pynvml or
  ``nvidia-smi`` when either is present, else ``None``.

The device fields (``name``, ``memory_total_bytes``, ``compute_capability``, ``index``) describe the
device the run's engine used; they are ``None`` for a run on the CPU (the stack's versions are still
recorded, since they say what a CUDA run on this machine would have used).
"""
from __future__ import annotations

import shutil
import subprocess
from typing import Any

import torch


def gpu_environment(device: str | torch.device | None) -> dict[str, Any]:
    """The ``gpu`` block of ``summary.json``'s environment for an engine on ``device`` (``"cuda:1"``,
    ``torch.device("cpu")``, or ``None`` where the engine does not say)."""
    available = torch.cuda.is_available()
    index = _cuda_index(device) if available else None
    properties = torch.cuda.get_device_properties(index) if index is not None else None
    return {
        "index": index,
        "name": properties.name if properties is not None else None,
        "memory_total_bytes": int(properties.total_memory) if properties is not None else None,
        "compute_capability": f"{properties.major}.{properties.minor}" if properties is not None else None,
        "device_count": torch.cuda.device_count() if available else 0,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if available else None,
        "cuda_driver_api": _driver_cuda_version() if available else None,
        "driver": driver_version() if available else None,
    }


def _cuda_index(device: str | torch.device | None) -> int | None:
    """The CUDA index of ``device`` (the current device for a bare ``cuda``), ``None`` off CUDA."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except RuntimeError:  # a device string torch does not parse (a peer's own name for it)
        return None
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


def _driver_cuda_version() -> str | None:
    """The CUDA version the driver supports, as ``"major.minor"`` (the driver API encodes 12.4 as 12040)."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        encoded = int(get()) if get is not None else 0
    except RuntimeError:
        return None
    return f"{encoded // 1000}.{encoded % 1000 // 10}" if encoded > 0 else None


def driver_version() -> str | None:
    """The NVIDIA driver's version: pynvml (``nvidia-ml-py``) if importable, else the first line of
    ``nvidia-smi --query-gpu=driver_version``; ``None`` when neither answers."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            try:
                version = pynvml.nvmlSystemGetDriverVersion()
            finally:
                pynvml.nvmlShutdown()
            return version.decode() if isinstance(version, bytes) else str(version)
        except pynvml.NVMLError:  # NVML not loadable here: fall through to nvidia-smi
            pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None
