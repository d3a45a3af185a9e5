"""servelab's GEMM for few rows (``engine/csrc/gemm.c``): decode steps.

A decode step multiplies every weight matrix by only ``B`` rows. General GEMMs (MKL, oneDNN)
block for large matrices; this kernel repacks each weight once into panels of 3 vectors of
output columns and runs a register tile of 8 rows x 48 columns with AVX-512 (4 x 24 with AVX2),
prefetching the next panel while the row tiles compute. With AVX2 it measured 1.2-1.6x faster
than oneDNN's prepacked linear up to 24 rows; with AVX-512, 1.1-1.5x faster up to 128 rows over
the 30 layers' shapes with weights streamed from memory (docs/performance.md, sections 3.2 and 7).
So :class:`~engine.weight_copies.Linear` uses it up to :attr:`SkinnyGemm.max_rows` rows (the crossover
measured for the build's tile: 128 with AVX-512, 32 with AVX2) and oneDNN above.

Two builds of the same kernel: ``SkinnyGemm()`` keeps the panels in float32 (``engine/csrc/gemm.c``),
``SkinnyGemm(torch.bfloat16)`` in bfloat16 pairs and multiplies them with AVX512-BF16's dot-product
instruction (``engine/csrc/gemm_bf16.c``): half the weight bytes per step, twice the multiply-adds
per instruction, with x and W rounded to bfloat16 (docs/decisions.md, decision 19). On a CPU with
AMX, ``SkinnyGemm(torch.bfloat16, amx=True)`` multiplies the same bfloat16 panels on AMX's tile
unit instead (``engine/csrc/gemm_amx.c``: 16-row tiles, 8,192 multiply-adds per instruction), the
same products summed in another order; it beat both the AVX512-BF16 panels and oneDNN's bfloat16
copies from 8 to 256 rows, the rows it serves (decision 24). Inputs and outputs are float32 CPU tensors in every
build; compiled on first use like the other C kernels (``engine/native.py``).
"""
from __future__ import annotations

import ctypes

import torch

from engine import native

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def bf16_supported() -> bool:
    """Whether the bfloat16 build exists here: the compiler targets AVX512-BF16 (``-march=native`` on
    a CPU with it). ``False`` where the C kernels cannot be built at all."""
    try:
        return bool(native.function("gemm_bf16", "gemm_bf16_supported", [], _I64)())
    except native.NativeKernelUnavailable:
        return False


def amx_supported() -> bool:
    """Whether the AMX build exists here and this process may use AMX state: the compiler targets
    AMX (``-march=native`` on a CPU with amx_tile and amx_bf16) and the kernel grants the request.
    ``False`` where the C kernels cannot be built at all."""
    try:
        return bool(native.function("gemm_amx", "gemm_amx_supported", [], _I64)())
    except native.NativeKernelUnavailable:
        return False


class SkinnyGemm:
    """``pack`` a weight once, then ``linear(x, packed, bias, out_features)`` = ``x @ W.T + b``;
    ``dtype``: the panels' dtype (float32, or bfloat16 where :func:`bf16_supported`);
    ``max_rows``: the most rows for which this build beats oneDNN (larger inputs should not use it),
    lowered to ``row_limit`` where one is given (a faster oneDNN copy above it, e.g. bfloat16 on AMX);
    ``tile_rows``: rows of its full register tile (8 with AVX-512, 4 with AVX2; 16, a tile's rows, with AMX);
    ``amx``: bfloat16 panels multiplied on AMX tiles (where :func:`amx_supported`)."""

    def __init__(self, dtype: torch.dtype = torch.float32, row_limit: int | None = None, amx: bool = False) -> None:
        if dtype == torch.bfloat16:
            if not bf16_supported():
                raise ValueError("the bfloat16 skinny GEMM needs a CPU (and compiler target) with AVX512-BF16")
            library, suffix = "gemm_bf16", "bf16"
        elif dtype == torch.float32:
            library, suffix = "gemm", "f32"
        else:
            raise ValueError(f"the skinny GEMM's panels are float32 or bfloat16, not {dtype}")
        # the library that multiplies (its GEMM and row limit); the panels are packed by `library`
        gemm_library, gemm_name, max_rows_name = library, f"gemm_packed_{suffix}", f"{library}_max_rows"
        if amx:
            if dtype != torch.bfloat16 or not amx_supported():
                raise ValueError(f"the AMX skinny GEMM needs bfloat16 panels and a CPU (and compiler target) with AMX "
                                 f"(panels {dtype}, AMX: {amx_supported()})")
            gemm_library, gemm_name, max_rows_name = "gemm_amx", "gemm_packed_bf16_amx", "gemm_amx_max_rows"
        self.dtype, self.amx = dtype, amx
        if row_limit is not None and row_limit < 1:
            raise ValueError(f"row_limit must be >= 1, got {row_limit}")
        build_max_rows = native.function(gemm_library, max_rows_name, [], _I64)()
        self.max_rows: int = build_max_rows if row_limit is None else min(build_max_rows, row_limit)
        self.tile_rows: int = 16 if amx else native.function("gemm", "gemm_tile_rows", [], _I64)()
        numel_name = "packed_weight_numel" if dtype == torch.float32 else "packed_weight_numel_bf16"
        self._numel = native.function(library, numel_name, [_I64, _I64], _I64)
        self._pack = native.function(library, f"pack_weight_{suffix}", [_P, _I64, _I64, _P])
        self._gemm = native.function(gemm_library, gemm_name, [_P, _I64, _I64, _I64, _P, _P, _I64, _P])
        self.address: int = ctypes.cast(self._gemm, ctypes.c_void_p).value  # for C callers (engine.native_layers)

    def packed_numel(self, out_features: int, in_features: int) -> int:
        """Elements (of :attr:`dtype`) of :meth:`pack`'s result for a weight ``[out_features, in_features]``."""
        return self._numel(out_features, in_features)

    def pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``weight [out, in]`` (float32, CPU) as panels of 48 (AVX-512) or 24 columns, k-major
        (zero-padded), in :attr:`dtype`, into ``out`` (contiguous, :meth:`packed_numel` elements of
        :attr:`dtype`) or a new tensor."""
        native.require_cpu_float32(weight, "the skinny GEMM", "the weight")
        weight = weight.detach().contiguous()
        out_features, in_features = weight.shape
        numel = self._numel(out_features, in_features)
        if out is not None and (out.numel() != numel or not out.is_contiguous() or out.dtype != self.dtype):
            raise ValueError(f"pack: out must be a contiguous {self.dtype} tensor of {numel} elements")
        packed = torch.empty(numel, dtype=self.dtype) if out is None else out
        self._pack(weight.data_ptr(), out_features, in_features, packed.data_ptr())
        return packed

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """``x [M, in] @ W.T (+ bias)`` -> ``[M, out_features]`` with ``packed = pack(W)``."""
        native.require_cpu_float32(x, "the skinny GEMM", "the input")
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, in_features = x.shape
        out = torch.empty(rows, out_features)
        bias_pointer = None if bias is None else bias.contiguous().data_ptr()
        self._gemm(x.data_ptr(), rows, in_features, x.stride(0), packed.data_ptr(), bias_pointer, out_features, out.data_ptr())
        return out
