"""Where and how a run ran, recorded in ``summary.json`` so a number can be traced to its setup.

Configs say what was *asked* (``device: auto``, ``prepack: auto``); this says what was *applied*:
the resolved device and dtype, the performance options the engine actually turned on, the
attention and cache classes, library versions, the git commit (and whether the tree had local
changes), the CPU model and thread counts, and the GPU with its CUDA stack
(:mod:`experiments.harness.gpu_environment`).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from experiments.harness.gpu_environment import gpu_environment

ROOT = Path(__file__).resolve().parents[2]


def git_commit(root: Path = ROOT) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout (None outside git)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                             check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha, "dirty": bool(status.strip())}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:
        versions["transformers"] = None
    return versions


APPLIED_LOG_PREFIX = "engine applied: "  # serve.py logs its engine's applied_options as this prefix + JSON


def logged_applied_options(log_path: Path) -> dict[str, Any] | None:
    """The applied options serve.py logged at startup (its :data:`APPLIED_LOG_PREFIX` line) in the
    server log at ``log_path``; ``None`` when there is no such line."""
    for line in log_path.read_text(errors="replace").splitlines():
        if APPLIED_LOG_PREFIX in line:
            return json.loads(line.split(APPLIED_LOG_PREFIX, 1)[1])
    return None


def applied_options(engine: Any) -> dict[str, Any]:
    """What the engine object reports it applied (``None`` where an engine does not say). An
    engine that started a servelab server reports the server's engine (``server_applied_options``)."""
    server = getattr(engine, "server_applied_options", None) or {}
    own = _own_options(engine)
    return {**own, **{k: v for k, v in server.items() if k not in ("engine_class", "server_command")}}


def _own_options(engine: Any) -> dict[str, Any]:
    runner = getattr(engine, "runner", None)
    return {
        "device": str(engine.device) if getattr(engine, "device", None) is not None else None,
        "dtype": str(engine.dtype).removeprefix("torch.") if getattr(engine, "dtype", None) is not None else None,
        "engine_class": type(engine).__name__,
        "attention_class": type(engine.attention).__name__ if hasattr(engine, "attention") else None,
        "attention_backend": getattr(getattr(engine, "attention", None), "name", None),  # what attention=auto chose
        "cache_class": type(engine.cache).__name__ if hasattr(engine, "cache") else None,
        "prepacked": getattr(engine, "prepacked", None),
        "prefill_dtype": getattr(engine, "prefill_dtype", None),  # arithmetic of steps of many rows (prepacked copies dtype, or int16)
        "decode_dtype": getattr(engine, "decode_dtype", None),  # arithmetic of decode-sized steps (panels dtype, or int16)
        "kv_cache_dtype": getattr(engine, "kv_cache_dtype", None),  # the KV cache's dtype
        "prefill_attention_dtype": getattr(engine, "prefill_attention_dtype", None),  # long prompt chunks' attention arithmetic
        "skinny_gemm_max_rows": getattr(engine, "skinny_gemm_max_rows", None),  # few-row GEMM path (simulator calibration)
        "skinny_gemm_tile_rows": getattr(engine, "skinny_gemm_tile_rows", None),  # its register tile (simulator calibration)
        "onednn_row_buckets": getattr(engine, "onednn_row_buckets", None),  # row padding of prepacked linears (same)
        "fused_ops": getattr(engine, "fused", None),
        # decode-sized steps run each decoder layer as one C call (engine/native_layers.py)
        "native_layers": getattr(getattr(engine, "model", None), "native_layers", None) is not None,
        "quantized_weights": getattr(engine, "quantized_weights", None),  # GGUF blocks used for few-row matmuls
        "kept_freed_memory": getattr(engine, "kept_freed_memory", None),
        "cuda_graphs": getattr(runner, "graphs", None) is not None if runner is not None else None,
        "server_command": getattr(engine, "server_command", None),  # a server the run started (HTTP engines)
    }


def environment(engine: Any) -> dict[str, Any]:
    applied = applied_options(engine)
    return {
        **applied,
        **library_versions(),
        "git": git_commit(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "gpu": gpu_environment(applied["device"]),  # the device the engine (or its server) ran on
    }
