"""Reduced-precision prefill (``LLM(prefill_dtype=...)``, engine/weight_copies.py).

* ``packed_linear`` on a bfloat16 copy computes the bfloat16-rounded product (float32 sums and
  output), and really rounds: it is not the float32 result.
* The engine with ``prefill_dtype=bfloat16`` keeps every step of at most the skinny GEMM's row limit
  bit-equal to the float32 engine (decode batches never see bfloat16) and rounds larger steps only.
* A prefill step of many rows gives logits close to float32's, and not equal to them.
* The option's values: float32 by default, ``auto`` by the CPU, clear errors where it cannot apply.
The accuracy on the real model and the speed are measured, not tested (docs/decisions.md, decision 18).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine import performance_options
from engine.weight_copies import onednn_bf16_supported, onednn_linear_supported, packed_linear, prepack_weight

needs_bf16 = pytest.mark.skipif(
    not (onednn_linear_supported(torch.device("cpu"), torch.float32) and onednn_bf16_supported()),
    reason="needs oneDNN and a CPU with bfloat16 dot products (AVX512-BF16 or AMX)",
)


def build(ckpt, **kwargs) -> LLM:
    options = dict(device="cpu", dtype="float32", block_size=4, capacity_tokens=1024, max_num_seqs=8,
                   max_num_batched_tokens=512, chunked_prefill=False)
    options.update(kwargs)
    return LLM(model=str(ckpt), **options)


@needs_bf16
def test_bf16_packed_linear_is_the_bf16_rounded_product_in_float32():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(200, 64)
    out = packed_linear(x, prepack_weight(weight, dtype=torch.bfloat16), bias)
    assert out.dtype == torch.float32 and out.shape == (200, 96)
    rounded = F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias.bfloat16().float())
    torch.testing.assert_close(out, rounded, rtol=2e-2, atol=2e-2)  # bfloat16 output rounding at most
    exact = F.linear(x, weight, bias)
    assert (out - exact).abs().max() > 1e-3  # the inputs were rounded: not the float32 product


@needs_bf16
def test_bf16_engine_rounds_only_steps_above_the_skinny_gemm_limit(tiny_llama_ckpt):
    bf16, f32 = build(tiny_llama_ckpt, prefill_dtype="bfloat16"), build(tiny_llama_ckpt)
    assert bf16.prefill_dtype == "bfloat16" and f32.prefill_dtype == "float32"
    layer16, layer32 = bf16.model.layers[0].mlp.gate_up_proj, f32.model.layers[0].mlp.gate_up_proj
    assert layer16.packed.dtype == torch.bfloat16 and layer32.packed.dtype == torch.float32
    assert bf16.model.logits_head.packed.dtype == torch.bfloat16
    limit = layer16.skinny_max_rows
    assert limit > 0 and layer16.skinny is not None  # decode batches: float32 panels
    torch.manual_seed(1)
    with torch.inference_mode():
        few = torch.randn(limit, layer16.in_features)
        assert torch.equal(layer16(few), layer32(few))
        many = torch.randn(limit + 1, layer16.in_features)
        reference = F.linear(many, layer32.weight)
        torch.testing.assert_close(layer16(many), reference, rtol=5e-2, atol=5e-2)
        assert not torch.equal(layer16(many), layer32(many))


@needs_bf16
def test_bf16_prefill_logits_close_to_float32_not_equal(tiny_llama_ckpt):
    """Two prompts of 100 tokens in one unchunked step (200 rows: the oneDNN copies)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(100)] for _ in range(2)]
    logits = []
    for llm in (build(tiny_llama_ckpt, prefill_dtype="bfloat16"), build(tiny_llama_ckpt)):
        assert 200 > llm.skinny_gemm_max_rows
        for prompt in prompts:
            llm.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        plan = llm.scheduler.schedule()
        assert plan.num_batched_tokens == 200
        logits.append(llm.runner.execute(llm.runner.prepare(plan.scheduled)))
        llm.scheduler.retire([])
    bf16, f32 = logits
    assert bf16.dtype == torch.float32 and bf16.shape == f32.shape == (2, 256)
    scale = f32.abs().max()
    assert (bf16 - f32).abs().max() < 0.05 * scale  # bfloat16's 8-bit mantissa through 2 layers
    assert not torch.equal(bf16, f32)


def test_prefill_dtype_values_and_errors(tiny_llama_ckpt, monkeypatch):
    assert build(tiny_llama_ckpt).prefill_dtype == "float32"
    expected_auto = "bfloat16" if onednn_bf16_supported() and onednn_linear_supported(torch.device("cpu"), torch.float32) else "float32"
    assert build(tiny_llama_ckpt, prefill_dtype="auto").prefill_dtype == expected_auto
    with pytest.raises(ValueError, match="prefill_dtype must be float32, bfloat16, int16, int8 or auto"):
        build(tiny_llama_ckpt, prefill_dtype="float16")
    with pytest.raises(ValueError, match="prefill_dtype=bfloat16 needs prepack"):
        build(tiny_llama_ckpt, prefill_dtype="bfloat16", prepack=False)
    assert build(tiny_llama_ckpt, prepack=False, prefill_dtype="auto").prefill_dtype == "float32"
    monkeypatch.setattr(performance_options, "onednn_bf16_supported", lambda: False)  # a CPU without bf16 dot products
    with pytest.raises(ValueError, match="AVX512-BF16 or AMX"):
        build(tiny_llama_ckpt, prefill_dtype="bfloat16")
    assert build(tiny_llama_ckpt, prefill_dtype="auto").prefill_dtype == "float32"
