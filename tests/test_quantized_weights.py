"""Decode matmuls on a GGUF checkpoint's Q4_1 / Q8_0 blocks (engine/quantized_gemm.py).

The claim: the quantized GEMM multiplies with bitwise the float32 checkpoint's weights (the GGUF
conversion dequantizes with the same arithmetic) and only sums in another order. Checked on the
numbers (``d * q`` is exact in float32, so ``fma(d, q, m)`` is the gguf package's ``d * q + m``),
on the kernel (one-hot rows of x read the weights back bit for bit; random x within float32 noise
of ``x @ dequantize(W).T`` for every row count, ragged shapes, bias, both ISA builds), and on the
engine (every quantized projection reads back its float32 parameter exactly, greedy tokens equal
the float32 engine's and HF's, logits within float32 noise).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from native_builds import without_avx512
from engine.gguf_checkpoint import materialize_gguf
from engine.weight_copies import Linear
from engine.quantized_gemm import BLOCK_BYTES, QuantizedGemm
from gguf_writer import write_gguf
from hf_reference import hf_greedy
from test_optimizations import build, first_step_logits, ragged_prompts, serve

QTYPES = ("Q4_1", "Q8_0")


def quantized(rows: int, cols: int, qtype: str, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random weights ``[rows, cols]`` as GGUF blocks, and their float32 values (gguf's dequantize)."""
    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    blocks = quantize(weight, GGMLQuantizationType[qtype])
    return blocks, torch.from_numpy(dequantize(blocks, GGMLQuantizationType[qtype]).reshape(rows, cols).copy())


def quantized_gemm_builds(tmp_path) -> dict[str, QuantizedGemm]:
    """The kernel as the engine builds it and, on x86, the same source without AVX-512 (its AVX2
    path: 8-wide vectors, 4-row tiles), which an AVX-512 machine would otherwise never run."""
    builds = {"native": QuantizedGemm()}
    avx2 = QuantizedGemm()
    functions = {"_bytes": "quant_packed_bytes", "_pack": "quant_pack", "_gemm": "quant_gemm"}
    kernels = without_avx512(avx2, "quant_gemm.c", functions, tmp_path)
    if kernels is not None:
        kernels.quant_gemm_max_rows.restype = ctypes.c_int64
        avx2.max_rows = kernels.quant_gemm_max_rows()
        builds["no_avx512"] = avx2
    return builds


@pytest.mark.parametrize("qtype", QTYPES)
def test_block_dequantization_is_exact_in_float32(qtype):
    """``d * q`` is exact in float32 and ``fma(d, q, m)`` (one rounding of the exact ``d * q + m``)
    equals gguf's ``(d * q) + m``: the kernel's in-register weights are the checkpoint's, bitwise."""
    blocks, expected = quantized(64, 256, qtype, seed=0)
    raw = blocks.reshape(-1, BLOCK_BYTES[qtype])
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float64)
    if qtype == "Q4_1":
        m = raw[:, 2:4].copy().view(np.float16).astype(np.float64)
        nibbles = raw[:, 4:]
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=1).astype(np.float64)
    else:
        m, q = np.zeros_like(d), raw[:, 2:].copy().view(np.int8).astype(np.float64)
    product = d * q  # exact in float64 (at most 11 + 8 significant bits)
    assert np.array_equal(product.astype(np.float32).astype(np.float64), product)  # ... and in float32
    fma = (product + m).astype(np.float32)  # d * q + m exact in float64, rounded once: fma's result
    assert np.array_equal(fma.reshape(expected.shape), expected.numpy())


def test_kernel_reads_back_the_dequantized_weights_bitwise(tmp_path):
    """x = one-hot rows: every output is one weight times 1 plus zeros, exact, so the kernel
    returns the transposed weights bit for bit (padded last panel, both builds, both types)."""
    for name, gemm in quantized_gemm_builds(tmp_path).items():
        for qtype in QTYPES:
            blocks, expected = quantized(50, 96, qtype, seed=1)
            weight = gemm.pack(torch.from_numpy(blocks), qtype, 96)
            assert torch.equal(gemm.linear(torch.eye(96), weight, None), expected.T), f"{name} {qtype}"


def test_kernel_matches_the_float32_matmul_for_every_row_count(tmp_path):
    """Every row count through the register tiles and their remainders (8 / 4 / 2 / 1 rows with
    AVX-512, 4 / 2 / 1 without) up to past ``max_rows``; N not a multiple of the panel width;
    K of 1, 3 and 7 blocks; bias or none; a strided input. Within float32 noise of
    ``x @ dequantize(W).T`` (float64 reference)."""
    torch.manual_seed(0)
    for name, gemm in quantized_gemm_builds(tmp_path).items():
        for qtype in QTYPES:
            for out_features, in_features, with_bias in ((50, 224, True), (17, 32, False), (96, 96, True)):
                blocks, dense = quantized(out_features, in_features, qtype, seed=out_features)
                weight = gemm.pack(torch.from_numpy(blocks), qtype, in_features)
                bias = torch.randn(out_features) if with_bias else None
                for rows in [*range(1, gemm.max_rows + 3), 31]:
                    x = torch.randn(rows, in_features + 3)[:, 1:-2]  # rows one stride apart, not contiguous
                    expected = x.double() @ dense.double().T + (0 if bias is None else bias.double())
                    torch.testing.assert_close(
                        gemm.linear(x, weight, bias).double(), expected, rtol=1e-5, atol=1e-5,
                        msg=lambda text: f"{name} build, {qtype}, {rows} rows, N={out_features}, K={in_features}: {text}",
                    )


def test_pack_rejects_blocks_that_do_not_match_the_shape():
    gemm = QuantizedGemm()
    blocks, _ = quantized(8, 64, "Q4_1", seed=2)
    with pytest.raises(ValueError, match="do not hold"):
        gemm.pack(torch.from_numpy(blocks), "Q4_1", 96)
    with pytest.raises(ValueError, match="Q4_1"):
        gemm.pack(torch.from_numpy(blocks), "Q5_0", 64)


@pytest.fixture(scope="module", params=[("tiny_llama_ckpt", "Q4_1"), ("tiny_llama_ckpt", "Q8_0"), ("tiny_qwen2_ckpt", "Q4_1")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def quantized_gguf(request, tmp_path_factory):
    """A tiny checkpoint written as a GGUF file with every matrix in one block type (Llama: the
    Q/K rows permuted as llama.cpp stores them; Qwen2: q/k/v biases), and its converted folder."""
    ckpt_name, qtype = request.param
    ckpt = request.getfixturevalue(ckpt_name)
    tmp = tmp_path_factory.mktemp(f"{ckpt_name}-{qtype}")
    path = write_gguf(ckpt, tmp / "model.gguf", matrix_type=GGMLQuantizationType[qtype])
    return path, materialize_gguf(path, tmp / "cache"), qtype


def test_engine_projections_read_back_their_float32_parameters(quantized_gguf):
    """Every projection (fused qkv / gate_up: concatenated blocks, Llama's Q/K rows un-permuted)
    and the tied LM head multiply with exactly the float32 engine's weights."""
    path, _, qtype = quantized_gguf
    llm = build(path, quantized_weights=True)
    layers = llm.model_config.num_hidden_layers
    assert llm.quantized_weights == {"types": {qtype: 4 * layers + 1}, "max_rows": QuantizedGemm().max_rows,
                                    "integer_max_rows": 0, "integer_dtype": None}
    linears = [m for m in llm.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * layers and all(m.quantized is not None for m in linears)
    for module in linears:
        read = module.quantized_gemm.linear(torch.eye(module.in_features), module.quantized, None)
        assert torch.equal(read, module.weight.T)
    model = llm.model
    read = model.logits_head.quantized_gemm.linear(torch.eye(model.config.hidden_size), model.logits_head.quantized, None)
    assert torch.equal(read, model.embed_tokens.weight.T)


def test_engine_tokens_equal_float32_engine_and_hf_and_logits_close(quantized_gguf):
    """Greedy tokens of a ragged batch (decode steps of <= 7 rows take the quantized GEMM) equal
    the float32 engine's and HF's on the converted folder; a prefill step of 12 rows (projections
    and LM head quantized) gives logits within float32 noise of the float32 engine's."""
    path, folder, _ = quantized_gguf
    fast, reference = build(path, quantized_weights="auto"), build(path, quantized_weights=False)
    assert fast.quantized_weights is not None and reference.quantized_weights is None
    calls = []
    gemm = fast.model.logits_head.quantized_gemm
    gemm_linear = gemm.linear
    gemm.linear = lambda *args: calls.append(args[0].shape[0]) or gemm_linear(*args)
    prompts = ragged_prompts(3, 7, fast.model_config.vocab_size)
    max_tokens = [1, 4, 9, 6, 12, 3, 8]
    tokens = serve(fast, prompts, max_tokens)
    assert calls and max(calls) <= gemm.max_rows  # decode steps ran on the blocks
    assert tokens == serve(reference, prompts, max_tokens)
    for prompt, budget, generated in zip(prompts, max_tokens, tokens):
        assert generated == hf_greedy(str(folder), tuple(prompt), budget)
    short = ragged_prompts(4, 4, fast.model_config.vocab_size, min_len=3, max_len=3)  # 12 rows <= max_rows
    ours, theirs = first_step_logits((fast, reference), short)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_option_is_auto_where_blocks_exist_and_rejected_where_they_do_not(tmp_path, tiny_llama_ckpt):
    assert build(tiny_llama_ckpt).quantized_weights is None  # a folder without GGUF blocks
    with pytest.raises(ValueError, match="quantized_weights"):
        build(tiny_llama_ckpt, quantized_weights=True)
    f32_file = write_gguf(tiny_llama_ckpt, tmp_path / "f32.gguf")  # F32 matrices: nothing to keep
    assert build(f32_file).quantized_weights is None
    q4 = write_gguf(tiny_llama_ckpt, tmp_path / "q4.gguf", matrix_type=GGMLQuantizationType.Q4_1)
    assert build(q4, dtype="bfloat16").quantized_weights is None
    with pytest.raises(ValueError, match="float32 on a CPU"):
        build(q4, dtype="bfloat16", quantized_weights=True)
    with pytest.raises(ValueError, match="quantized_weights must be"):
        build(q4, quantized_weights="yes")


def test_native_layers_run_the_quantized_gemm_up_to_its_rows(quantized_gguf):
    """Whole decoder layers in C (engine/native_layers.py) pick each linear's kernel as
    ``Linear.forward`` does: the blocks' GEMM up to its ``max_rows``, the skinny GEMM above. So
    every step's logits equal the Python layers' bit for bit (a C path that kept the float32
    panels for small steps would sum in another order)."""
    from test_optimizations import logits_of_every_step

    path, _, _ = quantized_gguf
    in_c, in_python = build(path, attention="cpu_paged"), build(path, attention="cpu_paged")
    in_python.model.use_native_layers(None)
    layers = in_c.model.native_layers
    gemm_rows = in_c.quantized_weights["max_rows"]
    assert layers is not None and [limit for limit, _ in layers._weights_by_limit] == [gemm_rows, layers.max_rows]
    quantized_kernels = set(QuantizedGemm().addresses.values())
    small, large = (weights[0].qkv.run for _, weights in layers._weights_by_limit)
    assert small in quantized_kernels and large not in quantized_kernels
    prompts = ragged_prompts(5, 7, in_c.model_config.vocab_size, min_len=1, max_len=2)  # a prefill <= 14 rows, 7-row decodes
    expected = logits_of_every_step(in_python, prompts, max_tokens=5)
    got = logits_of_every_step(in_c, prompts, max_tokens=5)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
