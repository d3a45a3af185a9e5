"""Decode step time by sampling mode: greedy, temperature 1, and temperature 0.7 + top-p 0.9.

For each batch size B, one running batch of B requests (prompts of random token ids, outputs with
``ignore_eos``) is prefilled; then its decode steps cycle through the modes, every live request's
sampling parameters switching before each step. The modes thus see the same contexts (a token
apart) and the same machine noise, which matters on a shared machine. Printed per B and mode: the
median decode step (the engine's own step clock: schedule + forward + sample), its ratio to the
greedy step, and the median time inside the sampler.

    python -m experiments.bench.sampling_step --batch-sizes 1 32 --steps 60
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams

MODES = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7 + top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
}


def step_times(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict[str, tuple[float, float]]:
    """Per mode, (median decode step seconds, median sampler seconds) of ``batch`` running requests."""
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    ids = [llm.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)], params) for _ in range(batch)]
    while not all(llm.requests[i].num_output_tokens for i in ids):  # the prefill, in as many steps as it takes
        llm.step()
    sampler, sampler_s = llm.sampler, [0.0]

    def timed_sampler(logits, seqs):
        start = time.perf_counter()
        tokens = sampler(logits, seqs)
        sampler_s[0] += time.perf_counter() - start
        return tokens

    llm.sampler = timed_sampler
    samples: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    try:
        for index in range(steps):
            mode = list(MODES)[index % len(MODES)]
            for i in ids:
                llm.requests[i].sampling_params = dataclasses.replace(params, **MODES[mode])
            sampler_s[0] = 0.0
            llm.step()
            record = llm.step_records[-1]
            if record.num_decode_tokens != batch or record.num_prefill_tokens:
                raise RuntimeError(f"step {record.step} is not a decode step of all {batch} requests")
            samples[mode].append((record.duration_s, sampler_s[0]))
    finally:
        llm.sampler = sampler
    while llm.has_unfinished():
        llm.step()
    return {mode: (statistics.median(s for s, _ in v), statistics.median(t for _, t in v)) for mode, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60, help="decode steps per batch size, cycling through the modes")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    args = parser.parse_args(argv)
    if args.steps < len(MODES):
        raise ValueError(f"--steps must be at least {len(MODES)} (one per mode), got {args.steps}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, max_num_seqs=max(args.batch_sizes))
    print("| batch | mode | decode step (ms) | / greedy | in the sampler (ms) |\n| --- | --- | --- | --- | --- |")
    for batch in args.batch_sizes:
        times = step_times(llm, batch, args.prompt_len, args.steps)
        greedy = times["greedy"][0]
        for mode, (step, sampling) in times.items():
            print(f"| {batch} | {mode} | {1e3 * step:.2f} | {step / greedy:.3f}x | {1e3 * sampling:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
