"""The model's linears at each row count: the skinny GEMM and oneDNN, each in float32 and bfloat16
(and the skinny GEMM's bfloat16 panels on AMX tiles where the CPU has AMX, the int8 integer GEMM
where it has AVX512-VNNI).

Which copy of a weight serves a step (engine/weight_copies.py) is chosen by the step's row count;
``prefill_dtype=bfloat16`` swaps the oneDNN copy's dtype, ``decode_dtype=bfloat16`` the skinny
GEMM's panels (where the compiler targets AVX512-BF16). This times, for the real model's layer
shapes (SmolLM2-135M: q/k/v fused, o, gate/up fused, down), every copy at row counts from decode
batches to prefill chunks, and prints the median milliseconds of one layer's linears (casts and
row padding included, as the engine runs them; a step runs 30 such layers) with the
float32 / bfloat16 ratio of each kernel. Where the CPU has AVX512-VNNI it adds the int8 integer
GEMM (``prefill_dtype=decode_dtype=int8``, engine/integer_gemm.py) on the same weights as Q4_1
blocks, every row count (as the engine sends it up to 4,096 rows), and bfloat16 oneDNN / int8.
The LM head is left out: it reads only the rows that sample, one per sequence. Weights are
random: timing only.

    python -m experiments.bench.linear_dtype --rows 1 8 32 128 256 1024 --repeats 7
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

import numpy as np

from engine.integer_gemm import IntegerGemm, int8_supported
from engine.skinny_gemm import SkinnyGemm, amx_supported, bf16_supported
from engine.weight_copies import onednn_bf16_supported, packed_linear, prepack_weight
from experiments.bench.quantized import random_blocks
from experiments.bench.roofline import seconds_per_call

# [out, in] of one SmolLM2-135M decoder layer's projections, fused as the engine fuses them
SHAPES = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not onednn_bf16_supported():
        raise SystemExit("this CPU has no bfloat16 dot products (AVX512-BF16 or AMX): nothing to compare")
    torch.manual_seed(0)
    weights = [torch.randn(out, inp) / inp ** 0.5 for out, inp in SHAPES]
    skinny_gemms = {"float32 skinny GEMM": SkinnyGemm()}
    if bf16_supported():
        skinny_gemms["bfloat16 skinny GEMM"] = SkinnyGemm(torch.bfloat16)
    if amx_supported():
        skinny_gemms["bfloat16 AMX skinny GEMM"] = SkinnyGemm(torch.bfloat16, amx=True)
    # each variant: one function per weight, of that weight's input
    variants: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        name: [partial(gemm.linear, packed=gemm.pack(w), bias=None, out_features=w.shape[0]) for w in weights]
        for name, gemm in skinny_gemms.items()
    }
    variants["float32 oneDNN"] = [partial(packed_linear, packed=prepack_weight(w), bias=None) for w in weights]
    variants["bfloat16 oneDNN"] = [partial(packed_linear, packed=prepack_weight(w, dtype=torch.bfloat16), bias=None)
                                   for w in weights]
    if int8_supported():
        int8 = IntegerGemm(prefill=True, activation_bits=8)
        rng = np.random.default_rng(0)
        variants["int8 integer GEMM"] = [partial(int8.linear, weight=int8.pack(random_blocks(rng, w.shape, "Q4_1")[0], "Q4_1", w.shape[1]),
                                                 bias=None) for w in weights]
    ratios = [("float32 skinny GEMM", "bfloat16 skinny GEMM"), ("float32 oneDNN", "bfloat16 oneDNN"),
              ("bfloat16 oneDNN", "bfloat16 AMX skinny GEMM"), ("bfloat16 oneDNN", "int8 integer GEMM")]
    ratios = [(f32, bf16) for f32, bf16 in ratios if bf16 in variants]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms for one layer's linears, "
          f"median of {args.repeats}")
    print("| rows | " + " | ".join(variants) + "".join(f" | {f32} / {bf16}" for f32, bf16 in ratios) + " |")
    print("| --- " * (len(variants) + len(ratios) + 1) + "|")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = [torch.randn(rows, inp) for _, inp in SHAPES]
            times: dict[str, float | None] = {}
            for name, kernels in variants.items():
                if name in skinny_gemms and rows > skinny_gemms[name].max_rows:
                    times[name] = None  # the engine never sends it more rows
                    continue
                # one warm-up call: oneDNN builds its primitive for this row count
                times[name] = 1000 * seconds_per_call(lambda: [kernel(x) for kernel, x in zip(kernels, inputs)],
                                                      torch.device("cpu"), args.repeats, warmup=1)
            cells = ["-" if t is None else f"{t:.2f}" for t in times.values()]
            cells += ["-" if times[f32] is None or times[bf16] is None else f"{times[f32] / times[bf16]:.2f}x" for f32, bf16 in ratios]
            print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
