"""Decode step time over a float32 and a bfloat16 KV cache, two engines in one process, steps interleaved.

A decode step reads every running sequence's whole context from the KV cache in each layer: with
many or long sequences those bytes rival the weights' (SmolLM2-135M: 46 KB per token in float32),
and ``kv_cache_dtype=bfloat16`` halves them (docs/decisions.md, decision 21). This builds the
engine twice, with ``kv_cache_dtype=model`` (float32) and ``bfloat16``, and otherwise the options
``run.py`` and ``serve.py`` apply (``prefill_dtype`` / ``decode_dtype`` ``auto``); prefills the same
``--batch-size`` random prompts of ``--prompt-len`` tokens into each; then times their greedy
decode steps alternately, one step of one engine then one of the other, so machine noise hits
both alike (the shared machines here drift by tens of percent within minutes). Printed: the
median step of each and the ratio, per shape.

    python -m experiments.bench.kv_cache_dtype --shapes 32x128 8x1024 --steps 30
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from engine import LLM, SamplingParams

DTYPES = ("model", "bfloat16")


def prefilled(kv_cache_dtype: str, batch: int, prompt_len: int, steps: int) -> LLM:
    """An engine whose ``batch`` running requests have all been prefilled (and decoded a few steps)."""
    llm = LLM(max_num_seqs=batch, prefill_dtype="auto", decode_dtype="auto", kv_cache_dtype=kv_cache_dtype)
    rng = random.Random(batch * 100_003 + prompt_len)
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    capacity = llm.cache.max_tokens_per_seq()
    if batch * (prompt_len + params.max_tokens) > capacity:
        raise ValueError(f"{batch} x ({prompt_len} + {params.max_tokens}) tokens exceed the KV cache's {capacity}: "
                         f"fewer sequences, shorter prompts or fewer --steps")
    ids = [llm.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)], params) for _ in range(batch)]
    while not all(llm.requests[i].num_output_tokens for i in ids):
        llm.step()
    for _ in range(3):  # past the first decode steps (their buffers and oneDNN primitives)
        llm.step()
    return llm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["32x128", "8x1024"],
                        help="running sequences x prompt tokens, e.g. 32x128")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per engine and shape")
    args = parser.parse_args(argv)
    print("| sequences | prompt tokens | float32 cache step (ms) | bfloat16 cache step (ms) | float32 / bfloat16 |\n"
          "| --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        batch, prompt_len = (int(part) for part in shape.split("x"))
        engines = {dtype: prefilled(dtype, batch, prompt_len, args.steps) for dtype in DTYPES}
        times: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
        for _ in range(args.steps):
            for dtype, llm in engines.items():
                start = time.perf_counter()
                outputs = llm.step()
                times[dtype].append(time.perf_counter() - start)
                if len(outputs) != batch:
                    raise RuntimeError(f"a {dtype} step decoded {len(outputs)} of {batch} sequences")
        f32, bf16 = (1e3 * statistics.median(times[dtype]) for dtype in DTYPES)
        print(f"| {batch} | {prompt_len} | {f32:.1f} | {bf16:.1f} | {f32 / bf16:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
