"""servelab's integer GEMM over GGUF blocks (``engine/csrc/int_gemm.c``, int16 activations;
``engine/csrc/int8_gemm.c``, int8): decode batches on CPUs without bfloat16 dot products, and an
opt-in int8 path on CPUs with AVX512-VNNI.

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
takes and at most :attr:`IntegerGemm.max_rows`: the decode batches (up to the C build's limit,
32 rows; ``decode_dtype=int16``) and, with ``prefill_dtype=int16``, prompt steps too, up to
:data:`PREFILL_MAX_ROWS` rows (the schedulers' token budgets fit). ``auto``
picks both on CPUs without bfloat16 dot products and without AVX-512, where they measured
faster (decision 20). CPU only; AVX2 and FMA; compiled on first use like the other C kernels
(``engine/native.py``).

``activation_bits=8`` (``decode_dtype=prefill_dtype=int8``) rounds the activations to int8 per
block of 32 instead (scale max |x| / 127, llama.cpp's recipe) and multiplies with AVX512-VNNI's
``vpdpbusd``, 64 byte pairs per instruction: twice bfloat16's multiply-adds, so prompt steps and
decode batches run 1.5-1.6x faster than bfloat16 oneDNN from 64 rows (decision 22). The weights
are still exact; the activations' rounding is ~1/254 of a block's largest value, and it moves the
real model's logits several times as far as bfloat16 compute does, so ``auto`` never takes it.
"""
from __future__ import annotations

import ctypes

from engine import native
from engine.quantized_gemm import BlockGemm


#: With ``prefill_dtype=int16`` the integer GEMM serves steps of up to this many rows; oneDNN's
#: float32 copies serve larger ones. One SmolLM2-135M layer's projections, Q4_1, against the
#: float32 kernel the engine would use (2 threads, 2-core AMD EPYC with AVX2 only, 2026-12-07 09:35
#: UTC, ``python -m experiments.bench.quantized --integer --threads 2``): 1.42-1.55x at 64-128 rows,
#: 1.23-1.30x at 256-1024, 1.19x at 2048, 1.08x at 4096 (docs/decisions.md, decision 20).
PREFILL_MAX_ROWS = 4096


#: The integer GEMM's C builds by the bits of their activations: ``int_gemm.c`` (int16, AVX2's
#: ``vpmaddwd``) and ``int8_gemm.c`` (int8, AVX512-VNNI's ``vpdpbusd``), with their functions' prefix.
LIBRARIES = {16: ("int_gemm", "int"), 8: ("int8_gemm", "int8")}


def int8_supported() -> bool:
    """Whether the int8 build exists here: the compiler targets AVX512-VNNI (``-march=native`` on a
    CPU with it). ``False`` where the C kernels cannot be built at all."""
    try:
        return bool(native.function("int8_gemm", "int8_gemm_supported", [], ctypes.c_int64)())
    except native.NativeKernelUnavailable:
        return False


class IntegerGemm(BlockGemm):
    """``activation_bits`` (16 or 8) activations x GGUF integer weights, int32 sums (see the module
    docstring). ``prefill``: also serve prompt steps, up to :data:`PREFILL_MAX_ROWS` rows (else the
    C build's decode limit)."""

    name = "the integer GEMM"

    def __init__(self, prefill: bool = False, activation_bits: int = 16) -> None:
        if activation_bits not in LIBRARIES:
            raise ValueError(f"the integer GEMM's activations have {sorted(LIBRARIES)} bits, not {activation_bits}")
        library, prefix = LIBRARIES[activation_bits]
        if activation_bits == 8 and not int8_supported():
            raise native.NativeKernelUnavailable("the int8 integer GEMM needs AVX512-VNNI in the C compiler's target (-march=native)")
        self.activation_bits = activation_bits
        self.dtype = f"int{activation_bits}"
        decode_max_rows = native.function(library, f"{prefix}_gemm_max_rows", [], ctypes.c_int64)()
        super().__init__(library, prefix, max(decode_max_rows, PREFILL_MAX_ROWS) if prefill else decode_max_rows)
