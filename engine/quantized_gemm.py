"""servelab's GEMM over GGUF-quantized weights (``engine/csrc/quant_gemm.c``): decode steps that
read 4-bit (Q4_1) or 8-bit (Q8_0) weights instead of float32 ones.

At a few rows a decode step streams every weight once, so its time is the bytes of the weights:
SmolLM2-135M's projections and LM head are 538 MB in float32 but 96 MB as the Q4_1 / Q8_0
blocks of its GGUF file. This kernel keeps the file's blocks (repacked once, byte for byte, into
panels of one vector of output rows), dequantizes each block in registers and multiplies it
with float32 activations. The weights it computes with are bitwise those of the float32
checkpoint (``d * q`` is exact in float32, see the C file), so only the summation order differs
from the float32 path, as between the skinny GEMM and oneDNN.
:class:`~engine.weight_copies.Linear` uses it up to :attr:`QuantizedGemm.max_rows` rows (the measured
crossover with the skinny GEMM: the C build's limit beside float32 panels, fewer beside bfloat16
ones, which stream half the bytes) and the skinny GEMM's weights above. CPU only; compiled on
first use like the other C kernels (``engine/native.py``); AVX-512, or AVX2 with F16C and FMA.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine import native

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
GGML_TYPES = {"Q4_1": 3, "Q8_0": 8}  # the types the kernel reads, with their ggml_type ids
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # bytes per block of 32 weights
BLOCK_WEIGHTS = 32
# Beside the skinny GEMM's bfloat16 panels the quantized GEMM is faster only up to this many rows
# (all 121 linears of SmolLM2-135M, 2 threads, 2-core AMD EPYC, 2026-12-06: 7.4 vs 8.4 ms at 4 rows,
# 11.5 vs 10.3 ms at 5; docs/decisions.md, decision 19).
MAX_ROWS_BESIDE_BF16_PANELS = 4


@dataclass
class QuantizedWeight:
    """One weight matrix ``[out_features, in_features]`` in the kernel's packed layout."""

    qtype: str
    packed: torch.Tensor  # uint8
    out_features: int
    in_features: int


class BlockGemm:
    """A GEMM over GGUF blocks, as one C library: ``pack`` a weight's blocks once, then ``linear(x,
    weight, bias)`` = ``x @ W.T + b``; ``max_rows``: the most rows it is used for; ``addresses``:
    per type, the GEMM with the skinny GEMM's signature, for C callers (engine.native_layers).
    ``library`` names the C file, ``prefix`` its functions (``{prefix}_packed_bytes``,
    ``{prefix}_pack``, ``{prefix}_gemm``, ``{prefix}_gemm_q4_1``, ``{prefix}_gemm_q8_0``)."""

    name = "a block GEMM"

    def __init__(self, library: str, prefix: str, max_rows: int) -> None:
        self.max_rows: int = max_rows
        self._bytes = native.function(library, f"{prefix}_packed_bytes", [_I64, _I64, _I64], _I64)
        self._pack = native.function(library, f"{prefix}_pack", [_P, _I64, _I64, _I64, _P])
        self._gemm = native.function(library, f"{prefix}_gemm", [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _P])
        self.addresses: dict[str, int] = {
            qtype: ctypes.cast(native.function(library, f"{prefix}_gemm_{qtype.lower()}", [_P, _I64, _I64, _I64, _P, _P, _I64, _P]),
                               ctypes.c_void_p).value
            for qtype in GGML_TYPES
        }

    def pack(self, blocks: torch.Tensor, qtype: str, in_features: int) -> QuantizedWeight:
        """``blocks``: the GGUF tensor's bytes, ``[out_features, in_features / 32 * block bytes]`` uint8."""
        if qtype not in GGML_TYPES:
            raise ValueError(f"{self.name} reads {sorted(GGML_TYPES)}, not {qtype}")
        out_features = blocks.shape[0]
        if in_features % BLOCK_WEIGHTS or blocks.dtype != torch.uint8 or blocks.shape[1:] != (
                in_features // BLOCK_WEIGHTS * BLOCK_BYTES[qtype],):
            raise ValueError(f"{qtype} blocks of shape {tuple(blocks.shape)} ({blocks.dtype}) do not hold "
                             f"a [{out_features}, {in_features}] weight")
        blocks = blocks.contiguous()
        packed = torch.empty(self._bytes(GGML_TYPES[qtype], out_features, in_features), dtype=torch.uint8)
        self._pack(blocks.data_ptr(), GGML_TYPES[qtype], out_features, in_features, packed.data_ptr())
        return QuantizedWeight(qtype, packed, out_features, in_features)

    def linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, in] @ W.T (+ bias)`` -> ``[M, out_features]`` in float32."""
        native.require_cpu_float32(x, self.name, "the input")
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, in_features = x.shape
        if in_features != weight.in_features:
            raise ValueError(f"input has {in_features} features, the weight {weight.in_features}")
        out = torch.empty(rows, weight.out_features)
        bias_pointer = None if bias is None else bias.contiguous().data_ptr()
        self._gemm(x.data_ptr(), rows, in_features, x.stride(0), weight.packed.data_ptr(), GGML_TYPES[weight.qtype],
                   bias_pointer, weight.out_features, out.data_ptr())
        return out


class QuantizedGemm(BlockGemm):
    """The float32 GEMM over GGUF blocks (``engine/csrc/quant_gemm.c``); ``max_rows``: the most rows
    for which this build beats the skinny GEMM whose panels are ``panel_dtype``."""

    name = "the quantized GEMM"

    def __init__(self, panel_dtype: torch.dtype = torch.float32) -> None:
        if panel_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the skinny GEMM's panels are float32 or bfloat16, not {panel_dtype}")
        build_max_rows = native.function("quant_gemm", "quant_gemm_max_rows", [], _I64)()
        super().__init__("quant_gemm", "quant",
                         build_max_rows if panel_dtype == torch.float32 else min(build_max_rows, MAX_ROWS_BESIDE_BF16_PANELS))
