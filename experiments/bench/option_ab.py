"""Decode step time of two engines that differ in one performance option, in one process, steps interleaved.

A performance option's effect on a decode step is a few percent to a few tens of percent, and the
shared machines here drift by tens of percent within minutes, so two runs one after the other
cannot tell it. This builds the engine twice with the options ``run.py`` and ``serve.py`` apply
(``prefill_dtype`` / ``decode_dtype`` / ``kv_cache_dtype`` / ``prefill_attention_dtype`` ``auto``)
apart from ``--option``, which takes each of the two ``--values``; prefills the same
``--batch-size`` random prompts of ``--prompt-len`` tokens into each; then times their decode
steps alternately, one step of one engine then one of the other, so machine noise hits both
alike. Printed: the median step of each and the ratio, per shape, and what each engine applied.

    python -m experiments.bench.option_ab --option decode_dtype --values float32 auto --shapes 32x128 16x128 8x128
    python -m experiments.bench.option_ab --option kv_cache_dtype --values model bfloat16 --shapes 32x128 8x1024
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from engine import LLM, SamplingParams

SERVE_DEFAULTS = {"prefill_dtype": "auto", "decode_dtype": "auto", "kv_cache_dtype": "auto", "prefill_attention_dtype": "auto"}


def prefilled(options: dict[str, Any], batch: int, prompt_len: int, steps: int, temperature: float = 0.0) -> LLM:
    """An engine with ``options`` over the serve defaults whose ``batch`` running requests have all
    been prefilled (and decoded a few steps)."""
    llm = LLM(max_num_seqs=batch, **{**SERVE_DEFAULTS, **options})
    rng = random.Random(batch * 100_003 + prompt_len)
    params = SamplingParams(max_tokens=steps + 64, temperature=temperature, ignore_eos=True)
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


def compare(option: str, values: list[str], shapes: list[str], steps: int, temperature: float = 0.0) -> None:
    """Print the median decode step of an engine per value of ``option``, per ``BxL`` shape."""
    print(f"| sequences | prompt tokens | {option}={values[0]} step (ms) | {option}={values[1]} step (ms) | first / second |\n"
          "| --- | --- | --- | --- | --- |")
    for shape in shapes:
        batch, prompt_len = (int(part) for part in shape.split("x"))
        engines = {value: prefilled({option: value}, batch, prompt_len, steps, temperature) for value in values}
        times: dict[str, list[float]] = {value: [] for value in values}
        for _ in range(steps):
            for value, llm in engines.items():
                start = time.perf_counter()
                outputs = llm.step()
                times[value].append(time.perf_counter() - start)
                if len(outputs) != batch:
                    raise RuntimeError(f"a {option}={value} step decoded {len(outputs)} of {batch} sequences")
        first, second = (1e3 * statistics.median(times[value]) for value in values)
        print(f"| {batch} | {prompt_len} | {first:.1f} | {second:.1f} | {first / second:.2f}x |", flush=True)
    for value, llm in engines.items():
        print(f"{option}={value} applied: {llm.performance}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--option", required=True, help="the performance option the two engines differ in, e.g. decode_dtype")
    parser.add_argument("--values", nargs=2, required=True, help="its two values, e.g. float32 auto")
    parser.add_argument("--shapes", nargs="+", default=["32x128", "8x1024"], help="running sequences x prompt tokens, e.g. 32x128")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per engine and shape")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the requests (0: greedy)")
    args = parser.parse_args(argv)
    compare(args.option, args.values, args.shapes, args.steps, args.temperature)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
