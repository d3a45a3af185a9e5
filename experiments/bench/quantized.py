"""The quantized GEMM (GGUF Q4_1 / Q8_0 blocks) vs the float32 skinny GEMM, and the decode step.

Kernels (default): the 30 layers' four projection shapes of SmolLM2-135M (960x576 qkv, 576x576 o,
3072x576 gate_up, 576x1536 down; distinct weights, so every call streams from memory) as Q4_1
and the 49152x576 LM head as Q8_0, each also dequantized and packed for the float32 skinny GEMM;
per row count the two kernels alternate rep by rep, min of ``--reps`` (thread CPU time with
``--threads 1``, a descheduled thread does not accrue it; wall time otherwise). The row count
where the ratio falls below 1 is the crossover that ``quant_gemm_max_rows()`` records
(docs/quantized_weights.md).

``--integer`` times the integer GEMM (engine/integer_gemm.py, int16 activations) against the
float32 kernels the engine would use instead at each row count (the skinny GEMM up to its rows,
oneDNN's prepacked copy above): one layer's four projections as Q4_1, alternating rep by rep, min of
``--reps``; the row count where it falls below 1 bounds ``PREFILL_MAX_ROWS``.

``--engine MODEL`` measures whole engine decode steps instead: two ``LLM``s on the model
(``quantized_weights=auto`` / ``false``, ``--decode-dtype`` for both, everything else default) serve ``B`` requests of
``--prompt`` tokens alternately, round by round; medians of the decode steps'
``StepRecord.duration_s``.

    python -m experiments.bench.quantized --threads 1 --rows 1 2 4 8 12 14 16 24
    python -m experiments.bench.quantized --integer --threads 2 --rows 8 32 128 256 512 1024 2048
    python -m experiments.bench.quantized --engine smollm2-135m-instruct --rows 1 4 8 14 16 --threads 2
    python -m experiments.bench.quantized --engine smollm2-135m-instruct --rows 1 2 4 6 8 12 16 --threads 2 --decode-dtype auto
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.integer_gemm import IntegerGemm
from engine.quantized_gemm import QuantizedGemm
from engine.skinny_gemm import SkinnyGemm
from engine.weight_copies import packed_linear, prepack_weight

LAYERS = 30
PROJECTIONS = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M: qkv, o, gate_up, down
HEAD = (49152, 576)


def random_blocks(rng: np.random.Generator, shape: tuple[int, int], qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight's GGUF blocks and the float32 weight they hold."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    blocks = quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), GGMLQuantizationType[qtype])
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, GGMLQuantizationType[qtype]).reshape(shape).copy())


def fastest_ms(calls: dict, reps: int, clock) -> dict[str, float]:
    """Each call's fastest time in ms over ``reps`` rounds, the calls alternating within a round."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(reps):
        for name, call in calls.items():
            start = clock()
            call()
            best[name] = min(best[name], (clock() - start) * 1e3)
    return best


def kernel_table(rows_list: list[int], reps: int, clock) -> None:
    quantized, skinny = QuantizedGemm(), SkinnyGemm()
    rng = np.random.default_rng(0)

    def both(shape: tuple[int, int], qtype: str) -> tuple:
        blocks, dense = random_blocks(rng, shape, qtype)
        return quantized.pack(blocks, qtype, shape[1]), skinny.pack(dense), shape

    projections = [both(shape, "Q4_1") for _ in range(LAYERS) for shape in PROJECTIONS]
    head = [both(HEAD, "Q8_0")]
    print(f"max_rows: quantized {quantized.max_rows}, skinny {skinny.max_rows}; ms, min of {reps}")
    print("| rows | projections Q4_1 | float32 | ratio | LM head Q8_0 | float32 | ratio |\n|---|---|---|---|---|---|---|")
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k) for k in (576, 1536)}
        calls = {
            "pq": lambda: [quantized.linear(inputs[s[1]], q, None) for q, _, s in projections],
            "ps": lambda: [skinny.linear(inputs[s[1]], f, None, s[0]) for _, f, s in projections],
            "hq": lambda: [quantized.linear(inputs[s[1]], q, None) for q, _, s in head],
            "hs": lambda: [skinny.linear(inputs[s[1]], f, None, s[0]) for _, f, s in head],
        }
        best = fastest_ms(calls, reps, clock)
        print(f"| {rows} | {best['pq']:.2f} | {best['ps']:.2f} | {best['ps'] / best['pq']:.2f} "
              f"| {best['hq']:.2f} | {best['hs']:.2f} | {best['hs'] / best['hq']:.2f} |", flush=True)


def integer_table(rows_list: list[int], reps: int, clock) -> None:
    integer, skinny = IntegerGemm(prefill=True), SkinnyGemm()
    rng = np.random.default_rng(0)
    layer = []
    for shape in PROJECTIONS:
        blocks, dense = random_blocks(rng, shape, "Q4_1")
        layer.append((integer.pack(blocks, "Q4_1", shape[1]), skinny.pack(dense), prepack_weight(dense), shape))
    print(f"one layer's projections (Q4_1); the integer GEMM against float32; ms, min of {reps}")
    print("| rows | integer GEMM | float32 kernel | float32 ms | ratio |\n|---|---|---|---|---|")
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k) for k in (576, 1536)}
        use_skinny = rows <= skinny.max_rows
        calls = {
            "integer": lambda: [integer.linear(inputs[s[1]], q, None) for q, _, _, s in layer],
            "float32": (lambda: [skinny.linear(inputs[s[1]], f, None, s[0]) for _, f, _, s in layer]) if use_skinny
            else (lambda: [packed_linear(inputs[s[1]], p, None) for _, _, p, s in layer]),
        }
        for call in calls.values():
            call()  # oneDNN builds its primitive for this row count
        best = fastest_ms(calls, reps, clock)
        print(f"| {rows} | {best['integer']:.3f} | {'skinny GEMM' if use_skinny else 'oneDNN'} | {best['float32']:.3f} "
              f"| {best['float32'] / best['integer']:.2f} |", flush=True)


def engine_table(model: str, batches: list[int], rounds: int, prompt: int, tokens: int, decode_dtype: str = "float32") -> None:
    engines = {"quantized": LLM(model=model, quantized_weights="auto", decode_dtype=decode_dtype),
               "float32": LLM(model=model, quantized_weights=False, decode_dtype=decode_dtype)}
    print(f"decode_dtype applied: {engines['float32'].decode_dtype} (AMX panels: "
          f"{engines['float32'].model.logits_head.skinny_gemm.amx})")
    print(f"quantized_weights applied: {engines['quantized'].quantized_weights}; median decode step ms")
    print("| B | quantized | float32 | float32 / quantized |\n|---|---|---|---|")
    for batch in batches:
        steps: dict[str, list[float]] = {name: [] for name in engines}
        prompts = [[1 + (7 * i + j) % 4000 for j in range(prompt)] for i in range(batch)]
        for _ in range(rounds):
            for name, llm in engines.items():
                first = len(llm.step_records)
                llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
                steps[name] += [s.duration_s for s in llm.step_records[first:]
                                if s.num_prefill_tokens == 0 and s.num_decode_tokens == batch]
        q, f = (statistics.median(steps[name]) * 1e3 for name in engines)
        print(f"| {batch} | {q:.2f} | {f:.2f} | {f / q:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 14, 16, 24],
                        help="rows of x (kernels) or decode batch sizes (--engine)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7, help="kernel repeats (min) or engine rounds (median)")
    parser.add_argument("--integer", action="store_true", help="time the integer GEMM against the float32 kernels instead")
    parser.add_argument("--engine", metavar="MODEL", default=None, help="time engine decode steps of this model instead")
    parser.add_argument("--prompt", type=int, default=128, help="--engine: prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=24, help="--engine: output tokens per request")
    parser.add_argument("--decode-dtype", default="float32",
                        help="--engine: both engines' decode_dtype (auto: the panels' dtype and kernel this CPU takes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    if args.engine is not None:
        engine_table(args.engine, args.rows, args.reps, args.prompt, args.tokens, args.decode_dtype)
    elif args.integer:
        integer_table(args.rows, args.reps, clock)
    else:
        kernel_table(args.rows, args.reps, clock)


if __name__ == "__main__":
    main()
