"""Reduced-precision decode (``LLM(decode_dtype=...)``, engine/skinny_gemm.py, engine/csrc/gemm_bf16.c).

* The bfloat16 skinny GEMM computes the bfloat16-rounded product (x and W rounded to nearest even,
  float32 sums and output) for every row tile and panel edge, and really rounds: it is not the
  float32 product.
* Built for a CPU without AVX512-BF16 the kernel says so, and ``decode_dtype=auto`` keeps float32.
* The engine with ``decode_dtype=bfloat16`` rounds steps of at most the skinny GEMM's row limit and
  keeps larger steps on the float32 oneDNN copies (the two options are independent); a decode
  step's logits are close to float32's, not equal.
* Beside bfloat16 panels the quantized GEMM serves fewer rows (the measured crossover).
* On a CPU with AMX the bfloat16 panels run on AMX tiles (engine/csrc/gemm_amx.c): the same
  bfloat16-rounded product for every tile and edge; a build without AMX says so.
* The option's values: float32 by default, ``auto`` by the CPU, clear errors where it cannot apply.
The accuracy on the real model and the speed are measured, not tested (docs/decisions.md, decision 19).
"""
from __future__ import annotations

import ctypes
import random

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams, performance_options
from engine.quantized_gemm import MAX_ROWS_BESIDE_BF16_PANELS, QuantizedGemm
from engine.skinny_gemm import SkinnyGemm, amx_supported, bf16_supported
from engine.weight_copies import onednn_linear_supported
from gguf import GGMLQuantizationType
from gguf_writer import write_gguf
from native_builds import build_without

needs_bf16_panels = pytest.mark.skipif(
    not (bf16_supported() and onednn_linear_supported(torch.device("cpu"), torch.float32)),
    reason="needs oneDNN and a CPU (and compiler target) with AVX512-BF16",
)


def build(ckpt, **kwargs) -> LLM:
    options = dict(device="cpu", dtype="float32", block_size=4, capacity_tokens=1024, max_num_seqs=8,
                   max_num_batched_tokens=512, chunked_prefill=False)
    options.update(kwargs)
    return LLM(model=str(ckpt), **options)


def bf16_rounded(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.bfloat16().float()


@needs_bf16_panels
def test_bf16_skinny_gemm_is_the_bf16_rounded_product_for_every_tile_and_edge():
    """Every row count through the 8 / 4 / 2 / 1-row tiles, N not a multiple of the 48-column
    panel, K odd (the last bfloat16 pair zero-padded), bias or none, a strided input."""
    torch.manual_seed(0)
    gemm = SkinnyGemm(torch.bfloat16)
    assert gemm.dtype == torch.bfloat16 and gemm.max_rows == 128
    for out_features, in_features, with_bias in ((50, 601, True), (96, 64, False)):
        weight = torch.randn(out_features, in_features) * 0.05
        bias = torch.randn(out_features) if with_bias else None
        panels = gemm.pack(weight)
        assert panels.dtype == torch.bfloat16 and panels.numel() == gemm.packed_numel(out_features, in_features)
        for rows in [*range(1, 18), 23, 32, 33, 128]:
            x = torch.randn(rows, in_features + 3)[:, 1:-2]  # rows one stride apart, not contiguous
            out = gemm.linear(x, panels, bias, out_features)
            expected = F.linear(bf16_rounded(x), bf16_rounded(weight), bias)  # the bias stays float32
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=f"{out_features}x{in_features}, {rows} rows")
            assert (out - F.linear(x, weight, bias)).abs().max() > 1e-4  # the inputs were rounded


@needs_bf16_panels
def test_bf16_pack_rounds_to_nearest_even():
    """Weights one bfloat16 ulp apart and exactly half-way: the panel holds what ``torch`` rounds to."""
    base = torch.tensor([1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -1.0 - 2.0**-9, 3.0e-3, -7.5])
    weight = (base.repeat(8)[:48].reshape(1, 48) * torch.linspace(0.5, 2.0, 48)).repeat(2, 1)
    gemm = SkinnyGemm(torch.bfloat16)
    out = gemm.linear(torch.eye(48), gemm.pack(weight.contiguous()), None, 2)  # column c = weight[:, c]
    assert torch.equal(out.T, bf16_rounded(weight))


def test_a_build_without_avx512_bf16_says_so(tmp_path):
    """The same source built for a CPU without the instruction: only ``gemm_bf16_supported``,
    returning 0, so ``SkinnyGemm(torch.bfloat16)`` and ``decode_dtype=bfloat16`` refuse there."""
    kernels = build_without("gemm_bf16.c", ["-mno-avx512bf16"], tmp_path)
    if kernels is None:
        pytest.skip("the compiler has no -mno-avx512bf16 (not x86)")
    kernels.gemm_bf16_supported.restype = ctypes.c_int64
    assert kernels.gemm_bf16_supported() == 0
    assert not hasattr(kernels, "gemm_packed_bf16")


@needs_bf16_panels
def test_bf16_engine_rounds_decode_sized_steps_only(tiny_llama_ckpt):
    bf16, f32 = build(tiny_llama_ckpt, decode_dtype="bfloat16"), build(tiny_llama_ckpt)
    assert bf16.decode_dtype == "bfloat16" and bf16.prefill_dtype == "float32" and f32.decode_dtype == "float32"
    layer16, layer32 = bf16.model.layers[0].mlp.gate_up_proj, f32.model.layers[0].mlp.gate_up_proj
    assert layer16.skinny_gemm.dtype == torch.bfloat16 and layer16.skinny.dtype == torch.bfloat16
    assert layer16.packed.dtype == torch.float32  # the oneDNN copy keeps its own dtype
    assert bf16.model.logits_head.skinny.dtype == torch.bfloat16
    limit = layer16.skinny_max_rows
    torch.manual_seed(1)
    with torch.inference_mode():
        few = torch.randn(limit, layer16.in_features)
        torch.testing.assert_close(layer16(few), F.linear(bf16_rounded(few), bf16_rounded(layer32.weight)), rtol=1e-5, atol=1e-5)
        assert not torch.equal(layer16(few), layer32(few))
        many = torch.randn(limit + 1, layer16.in_features)
        assert torch.equal(layer16(many), layer32(many))


@needs_bf16_panels
def test_bf16_decode_logits_close_to_float32_not_equal(tiny_llama_ckpt):
    """Three prompts prefilled (300 rows: the float32 oneDNN copies, then the LM head's 3 rows in
    bfloat16), then one decode step of 3 rows through the bfloat16 panels."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(100)] for _ in range(3)]
    logits = []
    for llm in (build(tiny_llama_ckpt, decode_dtype="bfloat16"), build(tiny_llama_ckpt)):
        assert 300 > llm.skinny_gemm_max_rows
        for prompt in prompts:
            llm.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        step_logits = []
        execute = llm.runner.execute
        llm.runner.execute = lambda inputs: step_logits.append(execute(inputs)) or step_logits[-1]
        llm.step()  # the prefill step (greedy: the same first tokens in both, so the same decode inputs)
        llm.step()  # the first decode step
        logits.append(step_logits)
    (prefill16, decode16), (prefill32, decode32) = logits
    for bf16_logits, f32_logits in ((prefill16, prefill32), (decode16, decode32)):  # the LM head's 3 rows: bfloat16 in both
        assert bf16_logits.shape == f32_logits.shape == (3, 256)
        assert (bf16_logits - f32_logits).abs().max() < 0.05 * f32_logits.abs().max()  # bfloat16's 8-bit mantissa
        assert not torch.equal(bf16_logits, f32_logits)


def test_quantized_gemm_serves_fewer_rows_beside_bf16_panels(tiny_llama_ckpt, tmp_path):
    assert QuantizedGemm(torch.bfloat16).max_rows == min(QuantizedGemm().max_rows, MAX_ROWS_BESIDE_BF16_PANELS)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        QuantizedGemm(torch.float16)
    if not (bf16_supported() and onednn_linear_supported(torch.device("cpu"), torch.float32)):
        return
    q4 = write_gguf(tiny_llama_ckpt, tmp_path / "q4.gguf", matrix_type=GGMLQuantizationType.Q4_1)
    llm = build(q4, decode_dtype="bfloat16")
    assert llm.quantized_weights["max_rows"] == MAX_ROWS_BESIDE_BF16_PANELS
    assert llm.model.layers[0].self_attn.qkv_proj.quantized_gemm.max_rows == MAX_ROWS_BESIDE_BF16_PANELS


def test_decode_dtype_values_and_errors(tiny_llama_ckpt, monkeypatch):
    assert build(tiny_llama_ckpt).decode_dtype == "float32"
    expected_auto = "bfloat16" if bf16_supported() and onednn_linear_supported(torch.device("cpu"), torch.float32) else "float32"
    assert build(tiny_llama_ckpt, decode_dtype="auto").decode_dtype == expected_auto
    with pytest.raises(ValueError, match="decode_dtype must be float32, bfloat16, int16, int8 or auto"):
        build(tiny_llama_ckpt, decode_dtype="float16")
    with pytest.raises(ValueError, match="decode_dtype=bfloat16 needs prepack"):
        build(tiny_llama_ckpt, decode_dtype="bfloat16", prepack=False)
    assert build(tiny_llama_ckpt, prepack=False, decode_dtype="auto").decode_dtype == "float32"
    monkeypatch.setattr(performance_options, "skinny_bf16_supported", lambda: False)  # a CPU without AVX512-BF16
    with pytest.raises(ValueError, match="AVX512-BF16 in the C compiler's target"):
        build(tiny_llama_ckpt, decode_dtype="bfloat16")
    assert build(tiny_llama_ckpt, decode_dtype="auto").decode_dtype == "float32"


@needs_bf16_panels
def test_beside_bf16_copies_on_amx_the_panels_follow_the_amx_kernel(tiny_llama_ckpt, monkeypatch):
    """With AMX and the AMX panel kernel, ``decode_dtype=auto`` takes bfloat16 panels on AMX tiles
    for every decode-sized step (its build's rows; whole layers in C up to them). With AMX but
    without that kernel, oneDNN's bfloat16 copies take every step above SKINNY_ROWS_BESIDE_AMX rows
    and ``auto`` keeps the panels float32. Without AMX the panels are bfloat16 (AVX512-BF16) and
    serve their build's rows. An explicit ``decode_dtype=bfloat16`` is honoured in every case."""
    if not performance_options.onednn_bf16_supported():
        pytest.skip("needs bfloat16 dot products in oneDNN")
    cases = [(True, False), (False, False)] + ([(True, True)] if amx_supported() else [])
    for amx, amx_panels in cases:
        monkeypatch.setattr(performance_options, "onednn_amx_supported", lambda amx=amx: amx)
        monkeypatch.setattr(performance_options, "skinny_amx_supported", lambda amx_panels=amx_panels: amx_panels)
        llm = build(tiny_llama_ckpt, prefill_dtype="bfloat16", decode_dtype="auto")
        assert llm.prefill_dtype == "bfloat16"
        assert llm.decode_dtype == ("float32" if amx and not amx_panels else "bfloat16")
        layer = llm.model.layers[0].mlp.down_proj
        assert layer.skinny_gemm.amx == amx_panels
        expected_rows = (performance_options.SKINNY_ROWS_BESIDE_AMX if amx and not amx_panels
                         else SkinnyGemm(torch.bfloat16, amx=amx_panels).max_rows)
        assert llm.skinny_gemm_max_rows == layer.skinny_max_rows == expected_rows
        assert llm.model.native_layers.max_rows == expected_rows
        explicit = build(tiny_llama_ckpt, prefill_dtype="bfloat16", decode_dtype="bfloat16")
        assert explicit.decode_dtype == "bfloat16" and explicit.model.logits_head.skinny_gemm.amx == amx_panels
    # float32 copies: nothing faster above the panels' rows, whatever the CPU
    monkeypatch.setattr(performance_options, "skinny_amx_supported", lambda: False)
    assert build(tiny_llama_ckpt, decode_dtype="auto").skinny_gemm_max_rows == SkinnyGemm().max_rows
    with pytest.raises(ValueError, match="row_limit must be >= 1"):
        SkinnyGemm(row_limit=0)


needs_amx = pytest.mark.skipif(not amx_supported(), reason="needs a CPU (and compiler target) with AMX")


@needs_amx
def test_amx_skinny_gemm_is_the_bf16_rounded_product_for_every_tile_and_edge():
    """The AMX kernel over the bfloat16 panels: every row count through full and partial 16-row
    tiles, N not a multiple of the 48-column panel, K with a tail of pairs that is not a whole
    tile (601: 301 pairs, 13 past the last full tile) and K a whole number of tiles, bias or none,
    a strided input, and NaN right after the panels (the k tail must not read past them); the same
    products as the AVX512-BF16 kernel over the same panels."""
    torch.manual_seed(0)
    gemm, avx512 = SkinnyGemm(torch.bfloat16, amx=True), SkinnyGemm(torch.bfloat16)
    assert gemm.amx and gemm.tile_rows == 16 and gemm.max_rows == 256
    for out_features, in_features, with_bias in ((50, 601, True), (96, 64, False), (200, 96, True)):
        weight = torch.randn(out_features, in_features) * 0.05
        bias = torch.randn(out_features) if with_bias else None
        numel = gemm.packed_numel(out_features, in_features)
        guarded = torch.full((numel + 4096,), float("nan"), dtype=torch.bfloat16)  # NaN past the panels: read, it shows
        panels = gemm.pack(weight, out=guarded[:numel])
        for rows in [*range(1, 18), 23, 32, 33, 128, 256]:
            x = torch.randn(rows, in_features + 3)[:, 1:-2]  # rows one stride apart, not contiguous
            out = gemm.linear(x, panels, bias, out_features)
            expected = F.linear(bf16_rounded(x), bf16_rounded(weight), bias)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=f"{out_features}x{in_features}, {rows} rows")
            torch.testing.assert_close(out, avx512.linear(x, panels, bias, out_features), rtol=1e-5, atol=1e-5)
            assert (out - F.linear(x, weight, bias)).abs().max() > 1e-4  # the inputs were rounded


def test_a_build_without_amx_says_so(tmp_path):
    """``gemm_amx.c`` built for a CPU without AMX: only ``gemm_amx_supported``, returning 0, so
    ``SkinnyGemm(amx=True)`` refuses there and ``auto`` keeps the other kernels."""
    kernels = build_without("gemm_amx.c", ["-mno-amx-tile", "-mno-amx-bf16"], tmp_path)
    if kernels is None:
        pytest.skip("the compiler has no -mno-amx-tile (not x86)")
    kernels.gemm_amx_supported.restype = ctypes.c_int64
    assert kernels.gemm_amx_supported() == 0
    assert not hasattr(kernels, "gemm_packed_bf16_amx")
    if not amx_supported():
        with pytest.raises(ValueError, match="the AMX skinny GEMM needs bfloat16 panels and a CPU"):
            SkinnyGemm(torch.bfloat16 if bf16_supported() else torch.float32, amx=True)
    with pytest.raises(ValueError, match="the AMX skinny GEMM needs bfloat16 panels"):
        SkinnyGemm(torch.float32, amx=True)
