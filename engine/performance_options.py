"""Performance options: how each ``auto | true | false`` becomes what the engine applies.

A performance option changes how a step is computed, never what it computes (docs/performance.md;
tests/test_optimizations.py holds every one to the plain path's tokens). Each option resolves the
same way (:func:`option_enabled`):

* ``"auto"`` applies it where it is supported (the device, the dtype, the checkpoint) and its C
  kernel builds; where the kernel cannot be built, a warning names the path taken instead;
* ``True`` requires it: a ``ValueError`` names what is missing, and a kernel's build error is raised;
* ``False`` keeps the plain PyTorch path.

The options (:class:`PerformanceOptions`, the keyword arguments of :class:`engine.LLM` and
``conf/engine/servelab.yaml``) are applied to a loaded model in one order, because later ones build
on earlier ones (:func:`apply_performance_options`): ``prepack`` gives each weight its oneDNN and
skinny-GEMM copies (:mod:`engine.weight_copies`); ``quantized_weights`` adds the GGUF blocks' copy;
``fused_ops`` swaps in the fused C kernels (and the sampler's draws,
:mod:`engine.sampling_kernels`) and, where every linear has a C kernel, runs whole
decoder layers in C (:mod:`engine.native_layers`); ``keep_freed_memory`` tunes ``malloc``.
``prefill_dtype`` picks the arithmetic of steps of many rows: the oneDNN copies' dtype (float32,
or bfloat16 where the CPU has bfloat16 dot products; docs/decisions.md, decision 18), or ``int16``,
the integer GEMM for prompt steps up to its row limit too (decision 20), and ``decode_dtype``
the arithmetic of decode-sized steps above the quantized GEMM's rows: the skinny GEMM's panels in
float32 or bfloat16 (decision 19), or ``int16``, the integer GEMM over the GGUF blocks with
activations rounded to int16 (:mod:`engine.integer_gemm`, decision 20; ``auto`` takes it on a
CPU without bfloat16 dot products and without AVX-512, and ``prefill_dtype=auto`` with it), or
``int8``, the same with int8 activations on AVX512-VNNI (opt-in, decision 22); and
``kv_cache_dtype`` the KV cache's dtype, the model's or bfloat16 (decision 21; ``auto`` takes
bfloat16 beside bfloat16 prompt steps, with an attention backend that reads it); and
``prefill_attention_dtype`` the arithmetic of long prompt chunks' attention over that cache, the
float32 C kernel's or bfloat16 flash attention (decision 23; ``auto`` takes bfloat16 on AMX): the
four options that change what a step computes. ``cuda_graphs`` is applied later, by the runner. What was
applied (:class:`AppliedOptions`) is what the engine reports and every run records
(``summary.json``'s ``environment``).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import host_memory
from engine.fused_ops import FusedOps
from engine.integer_gemm import PREFILL_MAX_ROWS, IntegerGemm
from engine.interfaces.attention import AttentionBackend
from engine.loader import load_quantized_blocks
from engine.model import CausalLM
from engine.model_config import ModelConfig
from engine.native import NativeKernelUnavailable
from engine.native_layers import NativeLayers
from engine.quantized_gemm import QuantizedGemm
from engine.skinny_gemm import SkinnyGemm
from engine.skinny_gemm import amx_supported as skinny_amx_supported
from engine.skinny_gemm import bf16_supported as skinny_bf16_supported
from engine.weight_copies import (
    ONEDNN_BUCKETS_PER_OCTAVE,
    onednn_amx_supported,
    onednn_bf16_supported,
    onednn_linear_supported,
)


@dataclass(frozen=True)
class PerformanceOptions:
    """The options as requested (each ``"auto"``, ``True`` or ``False``; see :class:`engine.LLM`)."""

    prepack: bool | str = "auto"  # oneDNN-prepacked and skinny-GEMM weight copies (CPU float32)
    quantized_weights: bool | str = "auto"  # decode matmuls read a GGUF checkpoint's Q4_1 / Q8_0 blocks
    fused_ops: bool | str = "auto"  # fused C kernels for add + RMSNorm, RoPE, SiLU-and-multiply, the sampler's draws (CPU float32)
    keep_freed_memory: bool | str = "auto"  # glibc malloc keeps freed activation buffers (CPU runs)
    cuda_graphs: bool = False  # replay decode-only steps as CUDA graphs (CUDA only)
    prefill_dtype: str = "float32"  # float32 | bfloat16 | int16 | int8 | auto: arithmetic of steps of many rows (oneDNN copies' dtype, or the integer GEMM)
    decode_dtype: str = "float32"  # float32 | bfloat16 | int16 | int8 | auto: arithmetic of decode-sized steps (skinny GEMM panels, or the integer GEMM)
    kv_cache_dtype: str = "model"  # model | bfloat16 | auto: the KV cache's dtype (model: the model's own)
    prefill_attention_dtype: str = "float32"  # float32 | bfloat16 | auto: arithmetic of prompt chunks' attention over a bfloat16 cache


#: With bfloat16 oneDNN copies on a CPU with AMX and panels that do not run on AMX tiles (float32
#: panels, or a compiler without AMX), the skinny GEMM serves at most this many rows:
#: oneDNN's AMX matmuls are faster above it (one SmolLM2 layer's linears, Xeon with AMX, 2 cores,
#: 2026-12-06 23:22 UTC: 0.35 ms at 12 rows against 0.46 / 0.52 ms for the bfloat16 / float32
#: panels, 0.43 against 1.18 / 1.02 ms at 32; the panels are faster up to 8; docs/decisions.md,
#: decision 19).
SKINNY_ROWS_BESIDE_AMX = 8

#: The integer GEMM's dtypes (``decode_dtype`` / ``prefill_dtype`` values) and their activations' bits.
INTEGER_DTYPES = {"int16": 16, "int8": 8}


@dataclass(frozen=True)
class AppliedOptions:
    """What :func:`apply_performance_options` applied on this device, dtype and checkpoint."""

    prepacked: bool  # every linear has its oneDNN-prepacked copy
    prefill_dtype: str  # arithmetic of prompt steps: the oneDNN copies' dtype ("float32" or "bfloat16"; "float32" when not prepacked), or "int16" / "int8" (the integer GEMM, up to its row limit)
    decode_dtype: str  # arithmetic of decode-sized steps: the skinny GEMM's panels' dtype ("float32" or "bfloat16"), or "int16" / "int8" (the integer GEMM)
    kv_cache_dtype: str  # the KV cache's dtype ("float32", "bfloat16", ...)
    prefill_attention_dtype: str  # arithmetic of long prompt chunks' attention: "float32" (the C kernel) or "bfloat16" (flash attention)
    skinny_gemm_max_rows: int  # linears of at most this many rows take the skinny GEMM (0: none)
    skinny_gemm_tile_rows: int  # rows of the skinny GEMM's full register tile (0: no skinny GEMM)
    onednn_row_buckets: int  # prepacked linears pad rows to this many buckets per octave (0: no padding)
    quantized_weights: dict[str, Any] | None  # {"types": {GGUF type: weights}, "max_rows": rows, "integer_max_rows": rows or 0, "integer_dtype": "int16" / "int8" / None}; None: not used
    fused: bool  # the fused C kernels run instead of the eager PyTorch ops
    kept_freed_memory: bool  # glibc's malloc was tuned to keep freed memory
    cuda_graphs: bool  # decode-only steps are to be captured as CUDA graphs (requested, on a CUDA device)


class AppliedOption:
    """An engine attribute that reads one field of the engine's ``performance`` (:class:`AppliedOptions`),
    e.g. ``LLM.prepacked``; an engine without ``performance`` (the simulator's) has no such attribute."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        if engine is None:
            return self
        return getattr(engine.performance, self.name)


def option_enabled(name: str, value: bool | str, supported: bool, requirement: str) -> bool:
    """Resolve an ``auto | true | false`` performance option: whether to apply it here.

    ``True`` where it is not ``supported`` raises (naming ``requirement``); ``"auto"`` applies it
    only where supported; anything else is rejected."""
    if value not in (True, False, "auto"):
        raise ValueError(f"{name} must be true, false or 'auto', got {value!r}")
    if value is True and not supported:
        raise ValueError(f"{name}=True needs {requirement}")
    return value is not False and supported


def build_kernel(name: str, value: bool | str, build: Callable[[], Any], fallback: str) -> Any | None:
    """A C kernel for option ``name`` (``build()``), or ``None`` with a warning naming ``fallback``
    when it cannot be built and the option is ``"auto"``; ``True`` re-raises the build error."""
    try:
        return build()
    except NativeKernelUnavailable as error:
        if value is True:
            raise
        warnings.warn(f"{name}=auto: {error}; {fallback}", stacklevel=4)  # the caller of apply_performance_options
        return None


def apply_performance_options(
    model: CausalLM, model_config: ModelConfig, checkpoint: Path, device: torch.device, dtype: torch.dtype,
    options: PerformanceOptions, attention: AttentionBackend,
) -> AppliedOptions:
    """Apply ``options`` to ``model`` (loaded from ``checkpoint`` on ``device`` in ``dtype``, served
    with ``attention``), in the order they build on each other, and say what was applied."""
    prepacked, skinny_gemm, packed_dtype = _prepack(model, device, dtype, options)
    panel_dtype = skinny_gemm.dtype if skinny_gemm is not None else torch.float32
    quantized = _quantized_weights(model, model_config, checkpoint, device, dtype, options, skinny_gemm)
    fused = _fused_ops(model, device, dtype, options.fused_ops)
    kept_freed_memory = _keep_freed_memory(device, options.keep_freed_memory)
    integer_rows = quantized["integer_max_rows"] if quantized is not None else 0
    prefill_dtype = quantized["integer_dtype"] if integer_rows >= PREFILL_MAX_ROWS else str(packed_dtype).removeprefix("torch.")
    kv_cache_dtype = _kv_cache_dtype(options.kv_cache_dtype, device, dtype, prefill_dtype, attention)
    return AppliedOptions(
        prepacked=prepacked,
        prefill_dtype=prefill_dtype,
        decode_dtype=quantized["integer_dtype"] if integer_rows else str(panel_dtype).removeprefix("torch."),
        kv_cache_dtype=str(kv_cache_dtype).removeprefix("torch."),
        prefill_attention_dtype=_prefill_attention_dtype(options.prefill_attention_dtype, kv_cache_dtype, attention),
        skinny_gemm_max_rows=skinny_gemm.max_rows if skinny_gemm is not None else 0,
        skinny_gemm_tile_rows=skinny_gemm.tile_rows if skinny_gemm is not None else 0,
        onednn_row_buckets=ONEDNN_BUCKETS_PER_OCTAVE if prepacked else 0,
        quantized_weights=quantized,
        fused=fused,
        kept_freed_memory=kept_freed_memory,
        cuda_graphs=bool(options.cuda_graphs) and device.type == "cuda",
    )


def _prepack(
    model: CausalLM, device: torch.device, dtype: torch.dtype, options: PerformanceOptions,
) -> tuple[bool, SkinnyGemm | None, torch.dtype]:
    """Whether the linears got their oneDNN copies, the skinny GEMM that got its panels (``None``:
    none; its ``dtype`` is the panels'), and the oneDNN copies' dtype."""
    supported = onednn_linear_supported(device, dtype)
    enabled = option_enabled("prepack", options.prepack, supported, f"float32 on a CPU with oneDNN (got {dtype} on {device})")
    packed_dtype = _reduced_dtype("prefill_dtype", options.prefill_dtype, enabled, onednn_bf16_supported(),
                                  "bfloat16 dot products in oneDNN, AVX512-BF16 or AMX")
    panel_requirement = "AVX512-BF16 in the C compiler's target (-march=native)"
    if not enabled:
        _reduced_dtype("decode_dtype", options.decode_dtype, False, False, panel_requirement)
        return False, None, packed_dtype
    # With AMX, bfloat16 panels run on AMX tiles where that kernel builds (faster than oneDNN's AMX
    # copies up to 128 rows; it serves up to 256, decision 24). Without it, bfloat16 oneDNN copies take the decode
    # batches above a few rows, and the few-row steps are the quantized GEMM's beside float32
    # panels: there `auto` keeps the panels float32.
    amx_panels = skinny_amx_supported()
    amx_onednn = packed_dtype == torch.bfloat16 and onednn_amx_supported()
    try:
        panel_dtype = _reduced_dtype("decode_dtype", options.decode_dtype, True, skinny_bf16_supported(), panel_requirement,
                                     auto_takes_bf16=amx_panels or not amx_onednn)
        amx = panel_dtype == torch.bfloat16 and amx_panels
        skinny_gemm = SkinnyGemm(panel_dtype, row_limit=SKINNY_ROWS_BESIDE_AMX if amx_onednn and not amx else None, amx=amx)
    except NativeKernelUnavailable as error:  # oneDNN packing alone still pays
        warnings.warn(f"prepack: {error}; few-row matmuls use oneDNN instead of the skinny GEMM", stacklevel=3)  # the caller of apply_performance_options
        skinny_gemm = None
    model.prepack(skinny_gemm=skinny_gemm, packed_dtype=packed_dtype)
    return True, skinny_gemm, packed_dtype


def _reduced_dtype(name: str, value: str, prepacked: bool, cpu_bf16: bool, requirement: str,
                   auto_takes_bf16: bool = True) -> torch.dtype:
    """A ``float32 | bfloat16 | int16 | int8 | auto`` dtype option (``prefill_dtype``, ``decode_dtype``)
    resolved to the copies' dtype: bfloat16 needs the prepacked copies and ``cpu_bf16`` (the
    kernel's bfloat16 dot products, ``requirement``); ``auto`` takes bfloat16 where both hold and
    ``auto_takes_bf16`` (it is the faster choice there), float32 elsewhere (the integer GEMM that
    ``auto`` may also add is :func:`_quantized_weights`' choice)."""
    if value in INTEGER_DTYPES:
        return torch.float32  # the copies stay float32; the integer GEMM is _quantized_weights' to add
    if value not in ("float32", "bfloat16", "auto"):
        raise ValueError(f"{name} must be float32, bfloat16, int16, int8 or auto, got {value!r}")
    bf16 = prepacked and cpu_bf16
    if value == "bfloat16" and not bf16:
        raise ValueError(f"{name}=bfloat16 needs prepack (a float32 model on a CPU with oneDNN) and {requirement} "
                         f"(prepack applied: {prepacked}, bfloat16 dot products: {cpu_bf16})")
    wanted = value == "bfloat16" or (value == "auto" and auto_takes_bf16)
    return torch.bfloat16 if wanted and bf16 else torch.float32


def _kv_cache_dtype(value: str, device: torch.device, dtype: torch.dtype, prefill_dtype: str,
                    attention: AttentionBackend) -> torch.dtype:
    """The KV cache's dtype: ``model`` keeps the model's; ``bfloat16`` stores K/V rounded to
    bfloat16, half the bytes attention reads per step (a float32 model on the CPU, with an attention
    backend that reads such a cache: ``cpu_paged``); ``auto`` takes bfloat16 there where the prompt
    steps compute with 8-bit activations or bfloat16 already (``prefill_dtype`` int8 or bfloat16:
    a CPU with AVX512-VNNI or bfloat16 dot products, the default of ``run.py`` and ``serve.py``),
    the model's dtype elsewhere (docs/decisions.md, decisions 21-22)."""
    if value not in ("model", "bfloat16", "auto"):
        raise ValueError(f"kv_cache_dtype must be model, bfloat16 or auto, got {value!r}")
    readable = (device.type == "cpu" and dtype == torch.float32
                and torch.bfloat16 in getattr(attention, "kv_cache_dtypes", ()))
    if value == "bfloat16" and dtype != torch.bfloat16 and not readable:
        raise ValueError(f"kv_cache_dtype=bfloat16 needs a float32 model on the CPU and an attention backend that reads "
                         f"a bfloat16 cache (cpu_paged); got {dtype} on {device}, attention={attention.name}")
    if value == "bfloat16" or (value == "auto" and readable and prefill_dtype in ("bfloat16", "int8")):
        return torch.bfloat16
    return dtype


def _prefill_attention_dtype(value: str, kv_cache_dtype: torch.dtype, attention: AttentionBackend) -> str:
    """The arithmetic of long prompt chunks' attention, applied to ``attention``: ``float32`` keeps
    the C kernel for every row; ``bfloat16`` gives the chunks that
    :class:`~strategies.attention.bf16_prompt_attention.PromptSplit` takes to torch's flash-attention
    kernel in bfloat16 (needs a bfloat16 KV cache and ``cpu_paged``); ``auto`` takes bfloat16 there
    on a CPU with AMX, where it measured 1.1-3.1x faster per chunk (decision 23), float32 elsewhere."""
    if value not in ("float32", "bfloat16", "auto"):
        raise ValueError(f"prefill_attention_dtype must be float32, bfloat16 or auto, got {value!r}")
    supported = kv_cache_dtype == torch.bfloat16 and hasattr(attention, "use_bf16_prompt_attention")
    if value == "bfloat16" and not supported:
        raise ValueError(f"prefill_attention_dtype=bfloat16 needs kv_cache_dtype bfloat16 and attention cpu_paged; "
                         f"got a {str(kv_cache_dtype).removeprefix('torch.')} cache and attention={attention.name}")
    if value == "bfloat16" or (value == "auto" and supported and onednn_amx_supported()):
        attention.use_bf16_prompt_attention()
        return "bfloat16"
    return "float32"


def _quantized_weights(
    model: CausalLM, model_config: ModelConfig, checkpoint: Path, device: torch.device, dtype: torch.dtype,
    options: PerformanceOptions, skinny_gemm: SkinnyGemm | None,
) -> dict[str, Any] | None:
    """``{"types": {GGUF type: weights using it}, "max_rows": rows, "integer_max_rows": rows,
    "integer_dtype": dtype}`` where applied, else ``None``; ``skinny_gemm``: the one that got its
    panels (their dtype sets the rows up to which the quantized GEMM is faster).
    ``decode_dtype=int16`` or ``int8`` adds the integer GEMM's copies with activations of that
    many bits (``integer_max_rows``, 0 without them; int8 needs AVX512-VNNI); ``auto`` adds the
    int16 ones where :func:`_auto_integer_dtype` says so.
    ``prefill_dtype`` of the same integer dtype (or ``auto`` there, beside ``auto``'s copies) lets
    them serve prompt steps too, up to :data:`~engine.integer_gemm.PREFILL_MAX_ROWS` rows; it
    needs the integer GEMM for decode batches, since one copy serves every row count from the
    quantized GEMM's limit up."""
    quantized = options.quantized_weights
    panel_dtype = skinny_gemm.dtype if skinny_gemm is not None else torch.float32
    cpu_float32 = device.type == "cpu" and dtype == torch.float32
    blocks = load_quantized_blocks(checkpoint, model_config) if cpu_float32 and quantized is not False else {}
    requirement = (f"float32 on a CPU and a checkpoint converted from a GGUF file with Q4_1 / Q8_0 weights "
                   f"(got {dtype} on {device}, checkpoint {checkpoint})")
    wanted = options.decode_dtype if options.decode_dtype in INTEGER_DTYPES else None
    prefill_wanted = options.prefill_dtype if options.prefill_dtype in INTEGER_DTYPES else None
    name = "decode_dtype" if wanted else "prefill_dtype"
    if (wanted or prefill_wanted) and (not blocks or quantized is False or skinny_gemm is None):
        raise ValueError(f"{name}={wanted or prefill_wanted} needs prepack and quantized_weights: {requirement} "
                         f"(quantized_weights={quantized!r}, prepack applied: {skinny_gemm is not None})")
    if not option_enabled("quantized_weights", quantized, bool(blocks), requirement):
        return None
    gemm = build_kernel("quantized_weights", quantized, lambda: QuantizedGemm(panel_dtype), "decode steps read the float32 weights")
    if gemm is None:
        return None
    auto_dtype = _auto_integer_dtype(skinny_gemm)
    decode = wanted or (auto_dtype if options.decode_dtype == "auto" else None)
    if prefill_wanted and prefill_wanted != decode:
        raise ValueError(f"prefill_dtype={prefill_wanted} needs decode_dtype {prefill_wanted} (or auto on a CPU that takes it): "
                         f"one integer copy serves every step from the quantized GEMM's {gemm.max_rows} rows up to "
                         f"{PREFILL_MAX_ROWS} (decode_dtype={options.decode_dtype!r})")
    prefill = prefill_wanted is not None or (options.prefill_dtype == "auto" and decode is not None and decode == auto_dtype)
    integer_gemm = None
    if decode is not None:
        integer_gemm = build_kernel("decode_dtype", True if wanted else "auto",
                                    lambda: IntegerGemm(prefill=prefill, activation_bits=INTEGER_DTYPES[decode]),
                                    "decode batches use the skinny GEMM")
    return {"types": model.use_quantized_weights(gemm, blocks, integer_gemm), "max_rows": gemm.max_rows,
            "integer_max_rows": integer_gemm.max_rows if integer_gemm is not None else 0,
            "integer_dtype": integer_gemm.dtype if integer_gemm is not None else None}


def _auto_integer_dtype(skinny_gemm: SkinnyGemm | None) -> str | None:
    """The integer GEMM ``auto`` takes on this CPU: int16 on an AVX2 CPU without bfloat16 dot
    products (the skinny GEMM's float32 panels of the AVX2 build, 4-row tiles), where it measured
    faster at no measurable cost in accuracy (decision 20); ``None`` elsewhere. Never int8: its
    8-bit activations move the logits several times as far as bfloat16 does (decision 22)."""
    if (skinny_gemm is not None and skinny_gemm.dtype == torch.float32 and skinny_gemm.tile_rows == 4
            and not onednn_bf16_supported() and not skinny_bf16_supported()):
        return "int16"
    return None


def _fused_ops(model: CausalLM, device: torch.device, dtype: torch.dtype, fused_ops: bool | str) -> bool:
    supported = device.type == "cpu" and dtype == torch.float32
    if not option_enabled("fused_ops", fused_ops, supported, f"float32 on a CPU (got {dtype} on {device})"):
        return False
    ops = build_kernel("fused_ops", fused_ops, FusedOps, "running the eager PyTorch ops instead")
    if ops is None:
        return False
    model.use_fused_ops(ops)
    if NativeLayers.available(model):  # every linear has a C kernel: decode-sized steps run layers in C
        model.use_native_layers(NativeLayers(model, ops))
    return True


def _keep_freed_memory(device: torch.device, keep: bool | str) -> bool:
    # Supported is only known by trying (glibc): True is checked after applying, below.
    if not option_enabled("keep_freed_memory", keep, keep is True or device.type == "cpu", ""):
        return False
    applied = host_memory.keep_freed_memory()
    if keep is True and not applied:
        raise ValueError("keep_freed_memory=True needs glibc's mallopt (Linux with glibc)")
    return applied
