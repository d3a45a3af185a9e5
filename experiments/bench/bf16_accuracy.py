"""How far bfloat16 compute moves the real model's logits and greedy tokens from float32.

Builds the default model (SmolLM2-135M-Instruct, real weights) as the float32 engine (the
reference) and as each variant: ``prefill_dtype=bfloat16`` (the oneDNN copies that serve steps of
more rows than the skinny GEMM in bfloat16), ``decode_dtype=bfloat16`` (the skinny GEMM's panels,
which serve decode steps above the quantized GEMM's rows and the LM head's rows), both, both
``auto`` with the KV cache's dtype (the default of ``conf/engine/servelab.yaml``: what this CPU gets) and
``dtype=bfloat16`` (every weight and activation in bfloat16: an upper bound), and
``decode_dtype=int16`` (the integer GEMM over the GGUF blocks, for CPUs without bfloat16 dot
products), ``prefill_dtype=decode_dtype=int16`` (that GEMM for the prompt step too), the same
with 8-bit activations (``int8``, AVX512-VNNI; alone and beside a bfloat16 KV cache) and
``kv_cache_dtype=bfloat16`` (float32 compute over K/V stored in bfloat16), alone and with
``prefill_attention_dtype=bfloat16`` (long prompts' attention in bfloat16 flash attention);
``--variants`` picks which to run. The questions are short (30-40 tokens); ``--context-tokens N``
puts N tokens of the bundled sample conversations (a different window for each question) before
each, so that the prompts' attention is long enough for ``prefill_attention_dtype`` to take it. On a set of real
questions, each through the chat template, it prints per prompt the max and mean absolute logit
difference from float32 of the first step (all prompts in one step of a few hundred rows: the
oneDNN path) and of the next step (one decode row per prompt, fed float32's first token: the
skinny GEMM's path), whether the next token agrees, and how many of ``--tokens`` greedy tokens
agree before the first difference.

    python -m experiments.bench.bf16_accuracy --tokens 32
    python -m experiments.bench.bf16_accuracy --tokens 32 --context-tokens 600
"""
from __future__ import annotations

import argparse
import json

import torch

from engine import LLM, SamplingParams
from engine.tokenizer import encode_chat
from experiments.harness.datasets import SAMPLE_DATASET

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


def two_step_logits(llm: LLM, prompts: list[list[int]], first_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's logits, as float32, from one prefill step of all ``prompts`` (last positions)
    and from the decode step after it, whose input is ``first_tokens`` (one per prompt, whatever
    this engine's own first step would pick, so every engine decodes the same inputs)."""
    ids = [llm.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True)) for prompt in prompts]
    forced = dict(zip(ids, first_tokens, strict=True))
    captured: list[torch.Tensor] = []
    execute, sampler = llm.runner.execute, llm.sampler
    llm.runner.execute = lambda inputs: captured.append(execute(inputs).float()) or captured[-1]
    llm.sampler = lambda logits, seqs: [forced[seq.seq_id] if seq.num_output_tokens == 0 else sampler(logits, [seq])[0]
                                        for seq in seqs]
    try:
        while llm.has_unfinished():
            llm.step()
    finally:
        llm.runner.execute, llm.sampler = execute, sampler
    assert len(captured) == 2 and all(len(logits) == len(prompts) for logits in captured), \
        "every prompt in each step: raise the token budget"
    return captured[0], captured[1]


def with_context(tokenizer, questions: list[str], context_tokens: int) -> list[str]:
    """Each question after ``context_tokens`` tokens of the bundled sample conversations' text, a
    window shifted by an equal step per question (the questions alone when 0)."""
    if context_tokens <= 0:
        return list(questions)
    conversations = json.loads(SAMPLE_DATASET.read_text())
    document = tokenizer.encode(" ".join(turn["value"] for entry in conversations for turn in entry["conversations"]))
    if len(document) < context_tokens:
        raise ValueError(f"--context-tokens {context_tokens}: the sample conversations hold {len(document)} tokens")
    stride = (len(document) - context_tokens) // max(1, len(questions) - 1)
    return [f"{tokenizer.decode(document[i * stride: i * stride + context_tokens])}\n\n{question}"
            for i, question in enumerate(questions)]


VARIANTS = {  # name: LLM keyword arguments beside the reference's
    "prefill_dtype=bfloat16": {"prefill_dtype": "bfloat16"},
    "decode_dtype=bfloat16": {"decode_dtype": "bfloat16"},
    "prefill_dtype=decode_dtype=bfloat16": {"prefill_dtype": "bfloat16", "decode_dtype": "bfloat16"},
    "kv_cache_dtype=bfloat16": {"kv_cache_dtype": "bfloat16"},  # K/V stored rounded to bfloat16, float32 compute
    "kv_cache_dtype=prefill_attention_dtype=bfloat16":  # and long prompts' attention in bfloat16
        {"kv_cache_dtype": "bfloat16", "prefill_attention_dtype": "bfloat16"},
    "every dtype option auto (run.py's and serve.py's default)":
        {"prefill_dtype": "auto", "decode_dtype": "auto", "kv_cache_dtype": "auto", "prefill_attention_dtype": "auto"},
    "dtype=bfloat16": {"dtype": "bfloat16"},
    "decode_dtype=int16": {"decode_dtype": "int16"},  # the integer GEMM (CPUs without bfloat16 dot products)
    "prefill_dtype=decode_dtype=int16": {"prefill_dtype": "int16", "decode_dtype": "int16"},  # and for prompt steps
    "prefill_dtype=decode_dtype=int8": {"prefill_dtype": "int8", "decode_dtype": "int8"},  # 8-bit activations (AVX512-VNNI)
    "prefill_dtype=decode_dtype=int8, kv_cache_dtype=bfloat16":
        {"prefill_dtype": "int8", "decode_dtype": "int8", "kv_cache_dtype": "bfloat16"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens generated per prompt")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="which variants to compare (the bfloat16 ones need AVX512-BF16 or AMX)")
    parser.add_argument("--context-tokens", type=int, default=0,
                        help="tokens of the bundled sample conversations before each question (0: the questions alone)")
    args = parser.parse_args()
    # one unchunked step holds every prompt whole, so each row is its prompt's last position
    common = dict(device="cpu", max_num_batched_tokens=max(4096, len(PROMPTS) * (args.context_tokens + 64)),
                  chunked_prefill=False)
    reference = LLM(dtype="float32", **common)
    engines = {name: LLM(**{"dtype": "float32", **common, **options}) for name, options in VARIANTS.items() if name in args.variants}
    prompts = [encode_chat(reference.tokenizer, [{"role": "user", "content": text}])
               for text in with_context(reference.tokenizer, PROMPTS, args.context_tokens)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    ref_tokens = [o.token_ids for o in reference.generate(prompts, params)]
    ref_logits = two_step_logits(reference, prompts, [tokens[0] for tokens in ref_tokens])
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} rows in the first step "
          f"(the skinny GEMM takes at most {reference.skinny_gemm_max_rows})")
    summary = []
    for name, llm in engines.items():
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        prefill, decode = (
            (reference_step - step).abs()
            for reference_step, step in zip(ref_logits, two_step_logits(llm, prompts, [t[0] for t in ref_tokens]))
        )
        print(f"\n{name} ({llm.prefill_dtype} prompt steps, {llm.decode_dtype} decode_dtype, skinny GEMM up to {llm.skinny_gemm_max_rows} rows) "
              "against float32 (max / mean abs logit diff):\n")
        print("| prompt | first step | decode step | next token agrees | greedy tokens equal before the first difference |")
        print("| --- | --- | --- | --- | --- |")
        same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(ref_tokens, tokens)]
        for index, text in enumerate(PROMPTS):
            agree = bool(ref_tokens[index][0] == tokens[index][0])
            print(f"| {text!r} | {prefill[index].max():.4f} / {prefill[index].mean():.4f} "
                  f"| {decode[index].max():.4f} / {decode[index].mean():.4f} | {agree} | {same[index]} / {args.tokens} |")
        per_prompt = {step: (diff.max(dim=-1).values, diff.mean(dim=-1)) for step, diff in (("first", prefill), ("decode", decode))}
        summary.append(
            f"| {name} | " + " | ".join(f"{m.min():.2f}-{m.max():.2f} / {a.min():.3f}-{a.max():.3f}" for m, a in per_prompt.values())
            + f" | {sum(a[0] == b[0] for a, b in zip(ref_tokens, tokens))} of {len(prompts)}"
            + f" | {sum(n == args.tokens for n in same)} of {len(prompts)} (fewest {min(same)}) |")
    print("\nSummary, per prompt: max abs logit diff range / mean abs logit diff range\n")
    print(f"| variant | first step | decode step | next token agrees | all {args.tokens} greedy tokens agree |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(summary))

if __name__ == "__main__":
    main()
