"""Hugging Face ``transformers`` as the correctness oracle: one cached HF model per checkpoint
(also behind the ``hf_model`` fixture) and greedy ``generate`` per prompt."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=512)
def hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """HF ``generate(do_sample=False)`` on one unpadded prompt, EOS ignored."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()
