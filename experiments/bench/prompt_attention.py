"""One prompt chunk's attention over a bfloat16 KV cache: the float32 C kernel against bfloat16 flash attention.

``cpu_paged`` attends every row with its C kernel (float32 arithmetic, K/V widened on load);
``prefill_attention_dtype=bfloat16`` gives sequences of many new tokens to torch's flash-attention
kernel in bfloat16 instead (:mod:`strategies.attention.bf16_prompt_attention`). This times one
layer's attention call for one sequence of ``q`` new tokens at the end of a context of ``n``
tokens (SmolLM2-135M's 9 query heads on 3 KV heads of 64 dims, a bf16 cache in 16-token blocks),
both paths alternating rep by rep (the split of the step, built once per step for all layers, is
built in the first call), and prints the medians and their ratio: where the bfloat16 path
starts to pay sets :class:`~strategies.attention.bf16_prompt_attention.PromptSplit` (docs/decisions.md,
decision 23).

``--prompts NxL`` times whole prefills in the engine instead: two engines with ``serve.py``'s
defaults (bf16 prompt steps and KV cache), one with ``prefill_attention_dtype=float32`` and one with
``bfloat16``, each prefill ``N`` random prompts of ``L`` tokens (in the default scheduler's
256-token chunks) and sample one token, alternately, ``--reps`` times; median seconds per round.

    python -m experiments.bench.prompt_attention --shapes 8x8 16x16 32x32 64x64 128x128 256x256 256x1024 --reps 30
    python -m experiments.bench.prompt_attention --prompts 1x1024 8x1024 32x128 --reps 5
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.attention_metadata import AttentionMetadata
from experiments.bench.option_ab import SERVE_DEFAULTS
from strategies.attention.bf16_prompt_attention import PromptSplit
from strategies.attention.cpu_paged import CpuPagedBackend

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def one_chunk(query_len: int, context_len: int) -> tuple[tuple[torch.Tensor, ...], AttentionMetadata]:
    """A step of one sequence: ``query_len`` new tokens ending a ``context_len``-token context."""
    blocks = -(-context_len // BLOCK_SIZE)
    cache = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM).bfloat16()
    tensors = (torch.randn(query_len, HEADS, HEAD_DIM), torch.randn(query_len, KV_HEADS, HEAD_DIM),
               torch.randn(query_len, KV_HEADS, HEAD_DIM), cache, cache.clone())
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32),
        query_lens=torch.tensor([query_len], dtype=torch.int32),
        context_lens=torch.tensor([context_len], dtype=torch.int32),
        slot_mapping=torch.arange(context_len - query_len, context_len, dtype=torch.int64),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        block_size=BLOCK_SIZE, max_query_len=query_len, max_context_len=context_len,
    )
    return tensors, metadata


def prefill_rounds(shapes: list[str], reps: int) -> None:
    """Median seconds to prefill each ``NxL`` shape's prompts, the two engines alternating."""
    engines = {dtype: LLM(**{**SERVE_DEFAULTS, "prefill_attention_dtype": dtype}) for dtype in ("float32", "bfloat16")}
    if engines["bfloat16"].kv_cache_dtype != "bfloat16":
        raise SystemExit("this CPU has no bfloat16 prompt steps (AVX512-BF16 or AMX), so no bfloat16 KV cache: nothing to compare")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    print("| prompts x tokens | float32 C kernel (s) | bfloat16 flash attention (s) | kernel / flash |\n| --- | --- | --- | --- |")
    for shape in shapes:
        count, length = (int(part) for part in shape.split("x"))
        rng = random.Random(count * 7919 + length)
        prompts = [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]
        times: dict[str, list[float]] = {dtype: [] for dtype in engines}
        for rep in range(reps + 1):  # the first round warms up each engine
            for dtype, llm in engines.items():
                start = time.perf_counter()
                llm.generate(prompts, params)
                if rep:
                    times[dtype].append(time.perf_counter() - start)
        kernel, flash = (statistics.median(times[dtype]) for dtype in engines)
        print(f"| {count} x {length} | {kernel:.3f} | {flash:.3f} | {kernel / flash:.2f}x |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["16x16", "64x64", "256x256", "256x1024"],
                        help="new tokens x context tokens, e.g. 256x1024")
    parser.add_argument("--prompts", nargs="+", default=None,
                        help="time whole prefills in the engine instead: prompts x tokens, e.g. 8x1024")
    parser.add_argument("--reps", type=int, default=30, help="timed calls (rounds with --prompts) per path and shape")
    args = parser.parse_args(argv)
    if args.prompts:
        prefill_rounds(args.prompts, args.reps)
        return 0
    backends = {"float32 C kernel": CpuPagedBackend(), "bfloat16 flash attention": CpuPagedBackend()}
    backends["bfloat16 flash attention"].use_bf16_prompt_attention(PromptSplit(min_rows=1, min_context=1, min_pairs=1))
    print(f"torch threads: {torch.get_num_threads()}\n"
          "| new tokens | context tokens | float32 C kernel (ms) | bfloat16 flash attention (ms) | kernel / flash |\n"
          "| --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        query_len, context_len = (int(part) for part in shape.split("x"))
        if not 1 <= query_len <= context_len:
            raise ValueError(f"--shapes {shape}: new tokens must be 1 .. context tokens")
        tensors, metadata = one_chunk(query_len, context_len)
        times: dict[str, list[float]] = {name: [] for name in backends}
        for rep in range(args.reps + 3):  # the first three calls warm up each path
            for name, backend in backends.items():
                start = time.perf_counter()
                backend.forward(*tensors, metadata, HEAD_DIM**-0.5)
                if rep >= 3:
                    times[name].append(time.perf_counter() - start)
        kernel, flash = (1e3 * statistics.median(times[name]) for name in backends)
        print(f"| {query_len} | {context_len} | {kernel:.3f} | {flash:.3f} | {kernel / flash:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
