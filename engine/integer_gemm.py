"""servelab's integer GEMM over GGUF blocks (``engine/csrc/int_gemm.c``): decode batches on CPUs
without bfloat16 dot products.

A decode batch of a few dozen rows is bound by arithmetic, not by the weights' bytes. Where the
CPU has AVX512-BF16 or AMX the engine multiplies those batches in bfloat16 (decision 19); on an
AVX2-only CPU (e.g. AMD Zen 3) the fastest multiply-add is ``vpmaddwd``: 16 pairs of int16 per
instruction, twice the float32 FMA's work. This kernel keeps a GGUF checkpoint's Q4_1 / Q8_0
weights as their integers ``q`` and float32 scales (so the weights are the float32
checkpoint's, exactly), quantizes each row's activations per block of 32 to int16 with a
power-of-two scale (15 bits), sums the products in int32 and scales each block's sum in
float32. The activations' rounding is the only change from float32: a few parts in 10^5 of a
block's largest value (measured on the real model's logits in docs/decisions.md, decision 20).

:class:`~engine.weight_copies.Linear` uses it for inputs of more rows than the quantized GEMM
takes and at most :attr:`IntegerGemm.max_rows` (``decode_dtype=int16``, which ``auto`` picks on
CPUs without bfloat16 dot products and without AVX-512, where it measured faster). CPU only;
AVX2 and FMA; compiled on first use like the other C kernels (``engine/native.py``).
"""
from __future__ import annotations

import ctypes

from engine import native
from engine.quantized_gemm import BlockGemm


class IntegerGemm(BlockGemm):
    """int16 activations x GGUF integer weights, int32 sums (see the module docstring)."""

    name = "the integer GEMM"

    def __init__(self) -> None:
        super().__init__("int_gemm", "int", native.function("int_gemm", "int_gemm_max_rows", [], ctypes.c_int64)())
