"""How far bfloat16 compute moves the real model's logits and greedy tokens from float32.

Builds the default model (SmolLM2-135M-Instruct, real weights) three times: the float32 engine
(the reference), ``prefill_dtype=bfloat16`` (the oneDNN copies that serve steps of more rows than
the skinny GEMM in bfloat16, everything else float32: what the option changes) and
``dtype=bfloat16`` (every weight and activation in bfloat16: an upper bound). On a set of real
questions, each through the chat template (so one step of all of them has a few hundred rows and
takes the oneDNN path), it prints per prompt the first step's max and mean absolute logit
difference from float32, whether the next token agrees, and how many of ``--tokens`` greedy tokens
agree before the first difference.

    python -m experiments.bench.bf16_accuracy --tokens 32
"""
from __future__ import annotations

import argparse

import torch

from engine import LLM, SamplingParams
from engine.tokenizer import encode_chat

PROMPTS = [
    "What is the capital of France?", "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.", "How many legs does a spider have?",
    "The history of the Roman Empire began", "def fibonacci(n):",
    "In mathematics, a prime number is", "Once upon a time, in a small village,",
    "Why is the sky blue?", "Give three tips for learning a new language.",
    "What does a compiler do?", "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?", "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Fahrenheit?", "List the planets of the solar system.",
]


def first_step_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt's last-position logits from one prefill step of all ``prompts``, as float32."""
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    plan = llm.scheduler.schedule()
    assert len(plan.scheduled) == len(prompts), "every prompt in the first step: raise the token budget"
    return llm.runner.execute(llm.runner.prepare(plan.scheduled)).float()


VARIANTS = {  # name: LLM keyword arguments beside the reference's
    "prefill_dtype=bfloat16": {"prefill_dtype": "bfloat16"},
    "dtype=bfloat16": {"dtype": "bfloat16"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens generated per prompt")
    args = parser.parse_args()
    # one unchunked step holds every prompt whole, so each row is its prompt's last position
    common = dict(device="cpu", max_num_batched_tokens=4096, chunked_prefill=False)
    reference = LLM(dtype="float32", **common)
    engines = {name: LLM(**{"dtype": "float32", **common, **options}) for name, options in VARIANTS.items()}
    prompts = [encode_chat(reference.tokenizer, [{"role": "user", "content": text}]) for text in PROMPTS]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    ref_tokens = [o.token_ids for o in reference.generate(prompts, params)]
    ref_logits = first_step_logits(reference, prompts)  # after generate: left queued
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} rows in the first step "
          f"(the skinny GEMM takes at most {reference.skinny_gemm_max_rows})")
    for name, llm in engines.items():
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        diff = (ref_logits - first_step_logits(llm, prompts)).abs()
        print(f"\n{name} against float32:\n")
        print("| prompt | max abs logit diff | mean abs logit diff | next token agrees | greedy tokens equal before the first difference |")
        print("| --- | --- | --- | --- | --- |")
        for index, text in enumerate(PROMPTS):
            a, b = ref_tokens[index], tokens[index]
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            agree = bool(a[0] == b[0])
            print(f"| {text!r} | {diff[index].max():.4f} | {diff[index].mean():.4f} | {agree} | {same} / {args.tokens} |")


if __name__ == "__main__":
    main()
