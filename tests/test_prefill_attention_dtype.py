"""Long prompt chunks' attention in bfloat16 (``LLM(prefill_attention_dtype=...)``; strategies/attention/bf16_prompt_attention.py).

* ``bfloat16`` over a bfloat16 KV cache gives prompt chunks the split takes to flash attention:
  a prefill step's logits stay close to the float32 kernel's over the same cache and are not
  equal (the path really runs), and the decode step after it still runs whole layers in C.
* The option's values: float32 by default, ``auto`` bfloat16 only beside a bfloat16 cache on a CPU
  with AMX, clear errors where there is no such cache or the value is unknown.
The backend's split is tested in tests/test_attention_backends.py; the accuracy on the real model
and the speed are measured, not tested (docs/decisions.md, decision 23).
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine import performance_options
from strategies.attention.bf16_prompt_attention import PromptSplit


def build(ckpt, **kwargs) -> LLM:
    options = dict(device="cpu", dtype="float32", block_size=4, capacity_tokens=1024, max_num_seqs=8,
                   max_num_batched_tokens=512, chunked_prefill=False, kv_cache_dtype="bfloat16")
    options.update(kwargs)
    return LLM(model=str(ckpt), **options)


def step_logits(llm: LLM, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    logits = []
    execute = llm.runner.execute
    llm.runner.execute = lambda inputs: logits.append(execute(inputs)) or logits[-1]
    for _ in range(steps):
        llm.step()
    return logits


def test_bfloat16_prompt_attention_in_the_engine(tiny_llama_ckpt):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(128)]]  # 128 rows: the C layers could take the step
    assert PromptSplit().takes(256, 256) and not PromptSplit().takes(128, 128)  # 128-token prompts stay in C
    flash, kernel = build(tiny_llama_ckpt, prefill_attention_dtype="bfloat16"), build(tiny_llama_ckpt)
    assert (flash.prefill_attention_dtype, kernel.prefill_attention_dtype) == ("bfloat16", "float32")
    assert flash.attention.bf16_prompts == PromptSplit() and kernel.attention.bf16_prompts is None
    flash.attention.use_bf16_prompt_attention(PromptSplit(min_context=128))  # the tiny model's contexts end at 256
    assert flash.model.native_layers is not None  # decode steps keep the C layers
    calls, forward = [], flash.model.native_layers.forward
    flash.model.native_layers.forward = lambda hidden, *args: calls.append(hidden.shape[0]) or forward(hidden, *args)
    (prefill16, decode16), (prefill32, decode32) = step_logits(flash, prompts, 2), step_logits(kernel, prompts, 2)
    assert prefill16.shape == prefill32.shape == (1, 256)
    assert (prefill16 - prefill32).abs().max() < 0.05 * prefill32.abs().max()
    assert not torch.equal(prefill16, prefill32)
    assert (decode16 - decode32).abs().max() < 0.05 * decode32.abs().max()
    # the prompt step ran the Python layers (flash attention; the C layers take 128 rows elsewhere), the decode step the C ones
    assert calls == [1]


def test_prefill_attention_dtype_values_and_errors(tiny_llama_ckpt, monkeypatch):
    assert build(tiny_llama_ckpt).prefill_attention_dtype == "float32"
    assert build(tiny_llama_ckpt, kv_cache_dtype="model", prefill_attention_dtype="auto").prefill_attention_dtype == "float32"
    with pytest.raises(ValueError, match="prefill_attention_dtype must be float32, bfloat16 or auto"):
        build(tiny_llama_ckpt, prefill_attention_dtype="float16")
    with pytest.raises(ValueError, match="needs kv_cache_dtype bfloat16 and attention cpu_paged; got a float32 cache "
                                         "and attention=cpu_paged"):
        build(tiny_llama_ckpt, kv_cache_dtype="model", prefill_attention_dtype="bfloat16")
    for amx, expected in ((False, "float32"), (True, "bfloat16")):  # auto: where it measured faster, on AMX
        monkeypatch.setattr(performance_options, "onednn_amx_supported", lambda amx=amx: amx)
        llm = build(tiny_llama_ckpt, prefill_attention_dtype="auto")
        assert llm.prefill_attention_dtype == expected
        assert (llm.attention.bf16_prompts is not None) == amx
