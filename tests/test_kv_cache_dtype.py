"""A bfloat16 KV cache (``LLM(kv_cache_dtype=...)``; strategies/attention/cpu_paged.py, engine/csrc/paged_attention.c).

* ``kv_cache_dtype=bfloat16`` allocates every layer's caches in bfloat16, and the first layer's
  stored K/V are the float32 engine's rounded to bfloat16, bit for bit (its K/V come before any
  attention; later layers read attention over rounded K/V, so theirs are only close).
* Both layer paths read and write that cache: a prompt step of many rows (the Python layers) and
  a decode step of few rows (whole layers in C); their logits stay close to the float32 cache's,
  and are not equal (the cache really rounds).
* The option's values: the model's dtype by default, ``auto`` bfloat16 only beside bfloat16 prompt
  steps, clear errors where a backend cannot read such a cache or the value is unknown.
The kernel itself is tested against the float32 kernel in tests/test_attention_backends.py; the
accuracy on the real model and the speed are measured, not tested (docs/decisions.md, decision 21).
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.weight_copies import onednn_bf16_supported


def build(ckpt, **kwargs) -> LLM:
    options = dict(device="cpu", dtype="float32", block_size=4, capacity_tokens=1024, max_num_seqs=8,
                   max_num_batched_tokens=512, chunked_prefill=False)
    options.update(kwargs)
    return LLM(model=str(ckpt), **options)


def prefill_then_decode(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits of the prompts' one prefill step and of the first decode step after it (greedy)."""
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    step_logits = []
    execute = llm.runner.execute
    llm.runner.execute = lambda inputs: step_logits.append(execute(inputs)) or step_logits[-1]
    llm.step()
    llm.step()
    return step_logits


def test_bfloat16_cache_rounds_what_float32_stores_and_both_layer_paths_read_it(tiny_llama_ckpt):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(60)] for _ in range(3)]
    bf16, f32 = build(tiny_llama_ckpt, kv_cache_dtype="bfloat16"), build(tiny_llama_ckpt)
    assert (bf16.kv_cache_dtype, f32.kv_cache_dtype) == ("bfloat16", "float32")
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in bf16.cache.kv_caches)
    assert 180 > bf16.skinny_gemm_max_rows >= 3  # the prefill step runs the Python layers, the decode step the C ones
    assert bf16.model.native_layers is not None
    (prefill16, decode16), (prefill32, decode32) = prefill_then_decode(bf16, prompts), prefill_then_decode(f32, prompts)
    slots = torch.tensor([slot for seq in range(3) for slot in slots_of(f32, seq)])
    assert torch.equal(slots, torch.tensor([slot for seq in range(3) for slot in slots_of(bf16, seq)]))
    for layer, ((k16, v16), (k32, v32)) in enumerate(zip(bf16.cache.kv_caches, f32.cache.kv_caches)):
        stored16 = [cache.flatten(0, 1)[slots] for cache in (k16, v16)]
        rounded32 = [cache.flatten(0, 1)[slots].bfloat16() for cache in (k32, v32)]
        for got, want in zip(stored16, rounded32):
            if layer == 0:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    for logits16, logits32 in ((prefill16, prefill32), (decode16, decode32)):
        assert logits16.shape == logits32.shape == (3, 256)
        assert (logits16 - logits32).abs().max() < 0.05 * logits32.abs().max()
        assert not torch.equal(logits16, logits32)


def slots_of(llm: LLM, seq_id: int) -> list[int]:
    """Cache slots of the prompt positions of request ``seq_id`` (its first 60 tokens)."""
    table, block = llm.requests[seq_id].block_table, llm.cache.block_size
    return [table[t // block] * block + t % block for t in range(60)]


def test_kv_cache_dtype_values_and_errors(tiny_llama_ckpt):
    assert build(tiny_llama_ckpt).kv_cache_dtype == "float32"
    assert build(tiny_llama_ckpt, kv_cache_dtype="auto").kv_cache_dtype == "float32"  # float32 prompt steps
    assert build(tiny_llama_ckpt, kv_cache_dtype="model", attention="torch_sdpa").kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype must be model, bfloat16 or auto"):
        build(tiny_llama_ckpt, kv_cache_dtype="float16")
    for attention in ("torch_sdpa", "cpu_paged_cascade"):
        with pytest.raises(ValueError, match=f"reads a bfloat16 cache \\(cpu_paged\\); got torch.float32 on cpu, attention={attention}"):
            build(tiny_llama_ckpt, kv_cache_dtype="bfloat16", attention=attention)
    if onednn_bf16_supported():  # auto follows the prompt steps' bfloat16, on a backend that reads the cache
        assert build(tiny_llama_ckpt, kv_cache_dtype="auto", prefill_dtype="bfloat16").kv_cache_dtype == "bfloat16"
        assert build(tiny_llama_ckpt, kv_cache_dtype="auto", prefill_dtype="bfloat16",
                     attention="torch_sdpa").kv_cache_dtype == "float32"
