"""How far bfloat16 compute moves the real model's logits and greedy tokens from float32.

Builds the default model (SmolLM2-135M-Instruct, real weights) twice, ``dtype=float32`` and
``dtype=bfloat16`` (every weight and activation in bf16: an upper bound on the error of bf16
linears alone), and on a set of real prompts prints the first step's max and mean absolute
logit difference, whether the next token agrees, and how many of ``--tokens`` greedy tokens agree
before the first difference.

    python -m experiments.bench.bf16_accuracy --tokens 32
"""
from __future__ import annotations

import argparse

import torch

from engine import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?", "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.", "How many legs does a spider have?",
    "The history of the Roman Empire began", "def fibonacci(n):",
    "In mathematics, a prime number is", "Once upon a time, in a small village,",
]


def first_step_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt's last-position logits from one prefill step of all ``prompts``, as float32."""
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    plan = llm.scheduler.schedule()
    return llm.runner.execute(llm.runner.prepare(plan.scheduled)).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens generated per prompt")
    args = parser.parse_args()
    # one unchunked step holds every prompt whole, so each row is its prompt's last position
    engines = {dtype: LLM(dtype=dtype, device="cpu", max_num_batched_tokens=None, chunked_prefill=False)
               for dtype in ("float32", "bfloat16")}
    prompts = [engines["float32"].tokenizer.encode(text) for text in PROMPTS]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    tokens = {dtype: [o.token_ids for o in llm.generate(prompts, params)] for dtype, llm in engines.items()}
    logits = {dtype: first_step_logits(llm, prompts) for dtype, llm in engines.items()}  # after generate: left queued
    diff = (logits["float32"] - logits["bfloat16"]).abs()
    print("| prompt | max abs logit diff | mean abs logit diff | next token agrees | greedy tokens equal before the first difference |")
    print("| --- | --- | --- | --- | --- |")
    for index, text in enumerate(PROMPTS):
        a, b = tokens["float32"][index], tokens["bfloat16"][index]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree = bool(logits["float32"][index].argmax() == logits["bfloat16"][index].argmax())
        print(f"| {text!r} | {diff[index].max():.4f} | {diff[index].mean():.4f} | {agree} | {same} / {args.tokens} |")


if __name__ == "__main__":
    main()
