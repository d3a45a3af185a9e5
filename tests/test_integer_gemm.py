"""The integer GEMM over GGUF blocks (engine/integer_gemm.py): int16 activations x the blocks' integer
weights, int32 sums per block of 32, scaled in float32.

The claims: the weights it multiplies with are the float32 checkpoint's exactly (one-hot rows read
them back bit for bit, which the power-of-two activation scale makes exact), the only rounding is
the activations' (random inputs stay within that rounding's bound of the float64 product, for every
row count the engine sends it, ragged output widths and a bias), and the engine routes decode
batches above the quantized GEMM's rows to it only when asked for and where it can.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM
from engine.integer_gemm import PREFILL_MAX_ROWS, IntegerGemm
from test_optimizations import build, first_step_logits, ragged_prompts, serve
from test_quantized_weights import QTYPES, quantized, quantized_gguf  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def gemm() -> IntegerGemm:
    return IntegerGemm()


@pytest.mark.parametrize("qtype", QTYPES)
def test_one_hot_rows_read_back_the_weights_bitwise(gemm, qtype):
    blocks, expected = quantized(50, 96, qtype, seed=1)  # 50 columns: the last 24-column panel padded
    weight = gemm.pack(torch.from_numpy(blocks), qtype, 96)
    assert torch.equal(gemm.linear(torch.eye(96), weight, None), expected.T)


@pytest.mark.parametrize("qtype", QTYPES)
def test_random_rows_within_the_activation_rounding_bound(gemm, qtype):
    """|error| <= sum_k (s_b / 2) |d q_k| (+ float32 summation noise), s_b the power of two that puts
    a row's block maximum in [2^14, 2^15) and |d q_k| <= |w_k| + |m| <= |w_k| + the block's max |w|
    (Q4_1's m, the block minimum, is added with the exact sum of x): rows 1 .. 40 (every tile
    tail), a bias."""
    out_features, in_features = 70, 160
    blocks, weight = quantized(out_features, in_features, qtype, seed=2)
    packed = gemm.pack(torch.from_numpy(blocks), qtype, in_features)
    bias = torch.randn(out_features)
    generator = torch.Generator().manual_seed(3)
    for rows in range(1, 41):
        x = torch.randn(rows, in_features, generator=generator) * torch.logspace(-2, 1, in_features)  # uneven blocks
        got = gemm.linear(x, packed, bias).double()
        exact = x.double() @ weight.double().T + bias.double()
        block_max = x.abs().reshape(rows, -1, 32).amax(dim=2)
        step = torch.exp2(torch.floor(torch.log2(block_max)) + 1 - 15).repeat_interleave(32, dim=1)  # s_b per k
        integer_part = weight.abs() + weight.abs().reshape(out_features, -1, 32).amax(dim=2).repeat_interleave(32, dim=1)
        bound = (step.double() / 2) @ integer_part.double().T + 1e-5 * (x.abs().double() @ weight.abs().double().T) + 1e-6
        assert torch.all((got - exact).abs() <= bound), f"{qtype}, {rows} rows"


def test_bad_input_gets_an_error_naming_the_limit(gemm):
    blocks, _ = quantized(24, 64, "Q8_0", seed=4)
    packed = gemm.pack(torch.from_numpy(blocks), "Q8_0", 64)
    with pytest.raises(ValueError, match="input has 32 features, the weight 64"):
        gemm.linear(torch.randn(3, 32), packed, None)
    with pytest.raises(ValueError, match="reads"):
        gemm.pack(torch.from_numpy(blocks), "Q5_0", 64)


def test_int16_needs_a_gguf_checkpoint():
    with pytest.raises(ValueError, match="decode_dtype=int16 needs prepack and quantized_weights"):
        LLM(model="tiny", decode_dtype="int16")
    with pytest.raises(ValueError, match="prefill_dtype=int16 needs prepack and quantized_weights"):
        LLM(model="tiny", prefill_dtype="int16")
    with pytest.raises(ValueError, match="float32, bfloat16, int16 or auto"):
        LLM(model="tiny", decode_dtype="int8")
    with pytest.raises(ValueError, match="prefill_dtype must be float32, bfloat16, int16 or auto"):
        LLM(model="tiny", prefill_dtype="int8")


def test_auto_never_takes_int16_without_gguf_blocks():
    assert LLM(model="tiny", decode_dtype="auto").decode_dtype in ("float32", "bfloat16")


def test_int16_engine_runs_prompt_and_decode_steps_on_the_integer_gemm(quantized_gguf):
    """``prefill_dtype=decode_dtype=int16`` on a GGUF checkpoint: one integer copy per weight
    serves every step from the quantized GEMM's rows up to ``PREFILL_MAX_ROWS``, so with two
    sequences more than the quantized GEMM serves, the 10-token prompts' step and the decode steps
    go through it (prompt rows in the projections, one row per sequence in the LM head and in the
    decode steps), and the prompt step's logits stay within 0.2% of their largest magnitude from
    the float32 engine's (the activations' rounding through every layer)."""
    path, _, _ = quantized_gguf
    options = dict(capacity_tokens=1024, max_num_seqs=32)
    fast, reference = build(path, prefill_dtype="int16", decode_dtype="int16", **options), build(path, **options)
    assert (fast.prefill_dtype, fast.decode_dtype) == ("int16", "int16")
    assert fast.quantized_weights["integer_max_rows"] == PREFILL_MAX_ROWS
    assert (reference.prefill_dtype, reference.decode_dtype) == ("float32", "float32")
    gemm = fast.model.logits_head.integer_gemm
    rows, gemm_linear = [], gemm.linear
    gemm.linear = lambda *args: rows.append(args[0].shape[0]) or gemm_linear(*args)
    # Every step through Linear.forward, where the rows are seen: steps of up to the skinny GEMM's
    # rows (32 with AVX2, 128 with AVX-512) would otherwise run whole layers in C.
    fast.model.use_native_layers(None)
    count = fast.quantized_weights["max_rows"] + 2
    prompts = ragged_prompts(6, count, fast.model_config.vocab_size, min_len=10, max_len=10)
    ours, theirs = first_step_logits((fast, reference), prompts)
    assert 10 * count in rows and count in rows  # the projections' prompt rows, the LM head's last positions
    assert (ours - theirs).abs().max() <= 2e-3 * theirs.abs().max()  # measured 0.2-1.1e-3 on these models
    with pytest.raises(ValueError, match="prefill_dtype=int16 needs decode_dtype int16"):
        build(path, prefill_dtype="int16", decode_dtype="float32")
    rows.clear()
    serve(fast, prompts, [5] * count)
    assert rows.count(count) > 5  # decode steps of one row per sequence
