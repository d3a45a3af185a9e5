"""Decode step time by sampling mode: greedy, temperature 1, and temperature 0.7 + top-p 0.9.

For each batch size B, one running batch of B requests (outputs with ``ignore_eos``) is
prefilled; then its decode steps cycle through the modes, every live request's sampling parameters
switching before each step. The modes thus see the same contexts (a token apart) and the same
machine noise, which matters on a shared machine. Printed per B and mode: the median decode step
(the engine's own step clock: schedule + forward + sample), its ratio to the greedy step, the
median time inside the sampler, and how many sampled rows needed more than the sampler's first
candidate set (``Sampler.widened``: a top-p head longer than the candidates).

What the filters cost depends on the logits, so the prompts matter: ``--prompts chat`` (the
default) sends real questions from servelab's chat prompt bank through the model's chat template,
so the model's next-token distributions are those of real answers (a top-p 0.9 head at
temperature 0.7 of tens of tokens); ``--prompts random`` sends ``--prompt-len`` random token ids,
which leave the model unsure (flat distributions, heads of hundreds to thousands of tokens): the
filters' worst case rather than the real one.

``--prefill-dtype`` / ``--decode-dtype`` / ``--kv-cache-dtype`` are the engine's options (default
``auto``, as ``run.py`` and ``serve.py`` run; ``float32`` / ``model`` for the float32 engine). ``--sampler torch``
draws with the PyTorch ops instead of the C kernels the engine takes with its fused ops
(``engine.sampling_kernels``): the A/B of those kernels.

    python -m experiments.bench.sampling_step --batch-sizes 1 32 --steps 60
    python -m experiments.bench.sampling_step --prefill-dtype float32 --decode-dtype float32
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.tokenizer import encode_chat
from experiments.harness.chat_prompts import prompt_bank

PREFILL_MARGIN = 256  # output tokens a request may decode before the whole batch is prefilled
MODES = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7 + top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
}


def prompts(llm: LLM, kind: str, batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` prompts as token ids: chat questions through the chat template, or random ids."""
    rng = random.Random(batch)
    if kind == "chat":
        return [encode_chat(llm.tokenizer, [{"role": "user", "content": text}]) for text in rng.sample(prompt_bank(), batch)]
    return [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(batch)]


def step_times(llm: LLM, batch: int, steps: int, prompt_ids: list[list[int]]) -> dict[str, tuple[float, float, int]]:
    """Per mode, (median decode step seconds, median sampler seconds, rows widened past the first
    candidate set over all its steps) of ``batch`` running requests."""
    # room for the tokens early requests decode while a chunked prefill admits the rest (a request
    # that still finishes early stops the run: the step check below sees fewer than ``batch`` rows)
    params = SamplingParams(max_tokens=steps + PREFILL_MARGIN, ignore_eos=True)
    ids = [llm.add_request(prompt, params) for prompt in prompt_ids]
    while not all(llm.requests[i].num_output_tokens for i in ids if i in llm.requests):  # the prefill
        llm.step()
    sampler, sampler_s = llm.sampler, [0.0]

    def timed_sampler(logits, seqs):
        start = time.perf_counter()
        tokens = sampler(logits, seqs)
        sampler_s[0] += time.perf_counter() - start
        return tokens

    llm.sampler = timed_sampler
    samples: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    widened = dict.fromkeys(MODES, 0)
    try:
        for index in range(steps):
            mode = list(MODES)[index % len(MODES)]
            for i in ids:
                llm.requests[i].sampling_params = dataclasses.replace(params, **MODES[mode])
            sampler_s[0] = 0.0
            before = sampler.widened
            llm.step()
            widened[mode] += sampler.widened - before
            record = llm.step_records[-1]
            if record.num_decode_tokens != batch or record.num_prefill_tokens:
                raise RuntimeError(f"step {record.step} is not a decode step of all {batch} requests")
            samples[mode].append((record.duration_s, sampler_s[0]))
    finally:
        llm.sampler = sampler
    for i in ids:
        llm.abort_request(i)
    while llm.has_unfinished():
        llm.step()
    return {mode: (statistics.median(s for s, _ in v), statistics.median(t for _, t in v), widened[mode])
            for mode, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompts", choices=["chat", "random"], default="chat",
                        help="chat: the prompt bank through the chat template; random: random token ids")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt with --prompts random")
    parser.add_argument("--steps", type=int, default=60, help="decode steps per batch size, cycling through the modes")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    parser.add_argument("--prefill-dtype", default="auto", choices=["auto", "bfloat16", "float32", "int16"])
    parser.add_argument("--decode-dtype", default="auto", choices=["auto", "bfloat16", "float32", "int16"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "model"])
    parser.add_argument("--sampler", default="engine", choices=["engine", "torch"],
                        help="engine: the sampler as the engine built it; torch: every draw by the PyTorch ops")
    args = parser.parse_args(argv)
    if args.steps < len(MODES):
        raise ValueError(f"--steps must be at least {len(MODES)} (one per mode), got {args.steps}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, max_num_seqs=max(args.batch_sizes), prefill_dtype=args.prefill_dtype,
              decode_dtype=args.decode_dtype, kv_cache_dtype=args.kv_cache_dtype)
    if args.sampler == "torch":
        llm.sampler.kernels = None
    print(f"prompts: {args.prompts}; steps per mode: {args.steps // len(MODES)}; {llm.prefill_dtype} prompt steps, "
          f"decode_dtype {llm.decode_dtype}, {llm.kv_cache_dtype} KV cache, skinny GEMM up to {llm.skinny_gemm_max_rows} rows; draws by "
          f"{'the C kernels' if llm.sampler.kernels is not None else 'the PyTorch ops'}")
    print("| batch | mode | decode step (ms) | / greedy | in the sampler (ms) | rows widened |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for batch in args.batch_sizes:
        times = step_times(llm, batch, args.steps, prompts(llm, args.prompts, batch, args.prompt_len))
        greedy = times["greedy"][0]
        for mode, (step, sampling, widened) in times.items():
            print(f"| {batch} | {mode} | {1e3 * step:.2f} | {step / greedy:.3f}x | {1e3 * sampling:.3f} | {widened} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
