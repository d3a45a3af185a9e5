"""Every performance optimisation keeps outputs identical (docs/performance.md).

* oneDNN-prepacked linears (``LLM(prepack=...)``): greedy tokens equal to the plain path and to
  HF, logits close, for the fused projections, the LM head, and an untied / biased model.
* The runner's vectorised step preparation (decode-only fast path, cached ``arange``): its
  metadata equals a straightforward per-row reference on ragged, chunked and decode steps, and
  an engine serving two different workloads back to back gives what fresh engines give.
* glibc malloc tuning (``LLM(keep_freed_memory=...)``): the option's values.
* Fused CPU kernels (``LLM(fused_ops=...)``, ``engine/fused_ops.py``): each kernel against the
  eager PyTorch form it replaces; the engine with them gives the eager engine's and HF's greedy
  tokens, logits within float32 noise; bad options and a missing compiler are reported.
* CUDA graphs (``LLM(cuda_graphs=True)``): tokens and logits equal to eager (CUDA only).
* ``experiments.bench.roofline``: the bound's byte / FLOP counts on a tiny model.
No timing asserts: speed is measured by ``experiments/bench/roofline.py`` and recorded in the doc.
"""
from __future__ import annotations

import random

import pytest
import torch

import torch.nn.functional as F

from native_builds import without_avx512
from engine import LLM, SamplingParams, native
from engine.attention_metadata import AttentionMetadata
from engine.fused_ops import FusedOps
from engine.native_layers import NativeLayers
from engine.model import RMSNorm, RotaryEmbedding, apply_rope
from engine.weight_copies import onednn_linear_supported, onednn_row_bucket, packed_linear, prepack_weight
from engine.skinny_gemm import SkinnyGemm
from engine.runner import ModelRunner
from hf_reference import hf_greedy
from strategies.attention.torch_sdpa import TorchSDPABackend

needs_onednn = pytest.mark.skipif(
    not onednn_linear_supported(torch.device("cpu"), torch.float32), reason="oneDNN not available"
)


def ragged_prompts(seed: int, count: int, vocab: int, min_len: int = 1, max_len: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def build(ckpt, **kwargs) -> LLM:
    options = dict(device="cpu", dtype="float32", block_size=4, capacity_tokens=512, max_num_seqs=8)
    options.update(kwargs)
    return LLM(model=str(ckpt), **options)


# a decode-only step of one sequence, for NativeLayers.can_run
DECODE_METADATA = AttentionMetadata(
    query_start_loc=torch.tensor([0, 1], dtype=torch.int32), query_lens=torch.tensor([1], dtype=torch.int32),
    context_lens=torch.tensor([5], dtype=torch.int32), slot_mapping=torch.tensor([4]),
    block_tables=torch.tensor([[0, 1]], dtype=torch.int32), block_size=4, max_query_len=1, max_context_len=5,
)


def serve(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate(prompts, params)
    llm.free_blocks_check()
    return [output.token_ids for output in outputs]


def assert_same_tokens_as_reference_and_hf(ckpt, fast: LLM, reference: LLM, seed: int) -> None:
    """The optimised engine serves a ragged batch with the reference engine's and HF's greedy tokens."""
    prompts = ragged_prompts(seed, 7, fast.model_config.vocab_size)
    max_tokens = [1, 4, 9, 6, 12, 3, 8]
    tokens = serve(fast, prompts, max_tokens)
    assert tokens == serve(reference, prompts, max_tokens)
    for prompt, budget, generated in zip(prompts, max_tokens, tokens):
        assert generated == hf_greedy(str(ckpt), tuple(prompt), budget)


def first_step_logits(llms: tuple[LLM, ...], prompts) -> list[torch.Tensor]:
    """Each engine's logits for the first (prefill) step of ``prompts``; nothing else is run."""
    logits = []
    for llm in llms:
        for prompt in prompts:
            llm.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        plan = llm.scheduler.schedule()
        logits.append(llm.runner.execute(llm.runner.prepare(plan.scheduled)))
        llm.scheduler.retire([])  # keep the requests; nothing else is run
    return logits


# -- prepacked (oneDNN) linears -------------------------------------------------------------------
@needs_onednn
@pytest.mark.parametrize("ckpt_name", ["tiny_llama_ckpt", "tiny_qwen2_ckpt", "odd_ckpt"])
def test_prepacked_linears_keep_tokens_equal_to_plain_and_hf(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    packed, plain = build(ckpt, prepack=True), build(ckpt, prepack=False)
    assert packed.prepacked and not plain.prepacked
    assert_same_tokens_as_reference_and_hf(ckpt, packed, plain, seed=0)


@needs_onednn
def test_prepacked_logits_close_to_plain(odd_ckpt):
    """Untied LM head and q/k/v/o biases through the packed path: logits within float32 noise."""
    packed, plain = build(odd_ckpt, prepack=True), build(odd_ckpt, prepack=False)
    prompts = ragged_prompts(3, 5, packed.model_config.vocab_size, min_len=2)
    logits = first_step_logits((packed, plain), prompts)
    assert logits[0].shape == (len(prompts), packed.model_config.vocab_size)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@needs_onednn
def test_packed_linear_serves_one_and_many_rows_and_min_rows_falls_back(tiny_llama_ckpt):
    """Packed for every row count by default (1 row included: faster once weights are cold,
    docs/performance.md section 3.3); below ``min_rows`` the plain ``F.linear`` runs, bit-equal."""
    llm = build(tiny_llama_ckpt, prepack=True)
    layer = llm.model.layers[0].mlp.gate_up_proj
    assert layer.min_rows == 1 and llm.model.logits_head.min_rows == 1
    layer.skinny = None  # the oneDNN path alone (the skinny GEMM has its own test below)
    x = torch.randn(5, layer.in_features)
    plain = torch.nn.functional.linear
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), plain(x, layer.weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x[:1]), plain(x[:1], layer.weight), rtol=1e-5, atol=1e-5)
        layer.min_rows = 2
        assert torch.equal(layer(x[:1]), plain(x[:1], layer.weight))


def test_onednn_row_buckets_are_few_and_pad_less_than_a_quarter():
    buckets = [onednn_row_bucket(rows) for rows in range(1, 8193)]
    assert all(bucket >= rows and 4 * (bucket - rows) < rows for rows, bucket in enumerate(buckets, start=1))
    assert all(onednn_row_bucket(bucket) == bucket for bucket in buckets)  # a bucket is its own bucket
    assert len(set(buckets)) <= 4 * 13 + 4  # 4 per octave: 8,192 row counts reach oneDNN as <= 56 shapes


@needs_onednn
def test_packed_linear_shows_onednn_only_bucketed_row_counts(monkeypatch):
    """oneDNN keeps a primitive per distinct row count (docs/reliability.md): every count it is
    called with is a bucket, and the unpadded rows come back within float32 noise of F.linear."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 40), torch.randn(96)
    packed = prepack_weight(weight)
    seen: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def recording(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording)
    for rows in (129, 200, 333, 1000, 1024):
        x = torch.randn(rows, 40)
        out = packed_linear(x, packed, bias)
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert seen == [onednn_row_bucket(rows) for rows in (129, 200, 333, 1000, 1024)] == [160, 224, 384, 1024, 1024]


@needs_onednn
def test_skinny_gemm_serves_decode_batches_and_onednn_the_rest(odd_ckpt):
    """Up to ``skinny_max_rows`` rows (decode batches up to the schedulers' default
    ``max_num_seqs`` and beyond) the skinny GEMM runs, above it oneDNN; both within float32 noise
    of ``F.linear`` (biased qkv of an odd model); the LM head too."""
    torch.manual_seed(0)
    llm = build(odd_ckpt, prepack=True)
    model = llm.model
    layer = model.layers[0].self_attn.qkv_proj  # biased
    assert layer.skinny is not None and layer.bias is not None and layer.skinny_max_rows >= 32
    # the register tile the simulator's cost model prices (engine/csrc/gemm.c: 8 rows with AVX-512, 4 with AVX2)
    assert llm.skinny_gemm_tile_rows == layer.skinny_gemm.tile_rows == {128: 8, 32: 4}[layer.skinny_max_rows]
    assert llm.onednn_row_buckets == 4  # larger inputs: rows padded to onednn_row_bucket (the cost model prices it)
    calls = []
    skinny_linear = layer.skinny_gemm.linear
    layer.skinny_gemm.linear = lambda *args: calls.append(args[0].shape[0]) or skinny_linear(*args)
    limit = layer.skinny_max_rows
    with torch.inference_mode():
        for rows in (1, 3, 32, limit, limit + 1, 2 * limit + 5):
            x = torch.randn(rows, layer.in_features)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        hidden = torch.randn(5, model.config.hidden_size)
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, head), rtol=1e-5, atol=1e-5)
    assert calls == [1, 3, 32, limit, 5]  # limit + 1 and more rows went to oneDNN; 5 = the LM head (shared instance)


def skinny_gemm_builds(tmp_path) -> dict[str, SkinnyGemm]:
    """The skinny GEMM as the engine builds it (``-march=native``) and, on x86, the same source
    built without AVX-512: the AVX2 register tile that the project's AVX2 machines run, which an
    AVX-512 machine would otherwise never test (``engine/csrc/gemm.c`` picks its tile at compile time)."""
    builds = {"native": SkinnyGemm()}
    no_avx512 = SkinnyGemm()
    functions = {"_numel": "packed_weight_numel", "_pack": "pack_weight_f32", "_gemm": "gemm_packed_f32"}
    if without_avx512(no_avx512, "gemm.c", functions, tmp_path) is not None:
        builds["no_avx512"] = no_avx512
    return builds


def test_skinny_gemm_every_row_tile_and_panel_edge(tmp_path):
    """Every row count through the register tiles and their remainders (8 / 4 / 2 / 1 rows with
    AVX-512, 4 / 2 / 1 without), N not a multiple of the panel width (the last panel is
    zero-padded and only its first columns are stored), K odd, bias or none, a strided input."""
    torch.manual_seed(0)
    for name, gemm in skinny_gemm_builds(tmp_path).items():
        for out_features, in_features, with_bias in ((50, 601, True), (96, 64, False)):
            weight = torch.randn(out_features, in_features) * 0.05
            bias = torch.randn(out_features) if with_bias else None
            panels = gemm.pack(weight)
            for rows in [*range(1, 18), 23, 31, 32, 33, 128]:
                x = torch.randn(rows, in_features + 3)[:, 1:-2]  # rows one stride apart, not contiguous
                torch.testing.assert_close(
                    gemm.linear(x, panels, bias, out_features), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5,
                    msg=lambda text: f"{name} build, {rows} rows, N={out_features}: {text}",
                )


def test_prepack_rejected_where_unsupported(tiny_llama_ckpt):
    with pytest.raises(ValueError, match="prepack"):
        build(tiny_llama_ckpt, prepack="yes")
    unpacked = build(tiny_llama_ckpt, dtype="bfloat16", prepack="auto")
    assert not unpacked.prepacked and unpacked.onednn_row_buckets == 0 and unpacked.skinny_gemm_tile_rows == 0
    with pytest.raises(ValueError, match="float32"):
        build(tiny_llama_ckpt, dtype="bfloat16", prepack=True)


# -- fused CPU kernels ---------------------------------------------------------------------------
def test_fused_add_rms_norm_matches_eager():
    ops, norm = FusedOps(), RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    x, residual = torch.randn(7, 96), torch.randn(7, 96) * 3
    expected_residual = residual + x
    out, new_residual = ops.add_rms_norm(x, residual.clone(), norm.weight, norm.eps)
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)  # the same float adds
    torch.testing.assert_close(out, norm(expected_residual), rtol=1e-6, atol=1e-6)
    first, same = ops.add_rms_norm(x, None, norm.weight, norm.eps)  # first layer: no residual yet
    assert same.data_ptr() == x.data_ptr()
    torch.testing.assert_close(first, norm(x), rtol=1e-6, atol=1e-6)


def test_fused_silu_and_mul_matches_eager_including_extremes():
    gate_up = torch.randn(5, 2 * 45) * 6  # 45: the vector loop's scalar tail runs too
    gate_up[0, :6] = torch.tensor([-1e4, -100.0, -88.0, 0.0, 88.0, 1e4])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(FusedOps().silu_and_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_fused_rope_matches_eager_on_a_strided_qkv_buffer():
    rotary = RotaryEmbedding(head_dim=32, max_positions=4096, theta=10000.0)
    qkv = torch.randn(6, 4 + 2 + 2, 32)  # 4 query heads, 2 KV heads: rotate the first 6 heads
    positions = torch.tensor([0, 1, 17, 400, 4095, 3])
    cos, signed_sin = rotary(positions, torch.float32)
    expected = apply_rope(qkv[:, :6], cos, signed_sin)
    rotated = qkv.clone()
    FusedOps().rope_(rotated, 6, positions, rotary.cos_sin)
    torch.testing.assert_close(rotated[:, :6], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(rotated[:, 6:], qkv[:, 6:])  # v untouched


@pytest.mark.parametrize("ckpt_name", ["tiny_llama_ckpt", "tiny_qwen2_ckpt", "odd_ckpt"])
def test_fused_ops_keep_tokens_equal_to_eager_and_hf(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    fused, eager = build(ckpt, fused_ops=True, attention="cpu_paged"), build(ckpt, fused_ops=False)
    assert fused.fused and not eager.fused
    assert_same_tokens_as_reference_and_hf(ckpt, fused, eager, seed=1)


def test_fused_ops_logits_close_to_eager(odd_ckpt):
    fused, eager = build(odd_ckpt, fused_ops=True), build(odd_ckpt, fused_ops=False)
    logits = first_step_logits((fused, eager), ragged_prompts(4, 5, fused.model_config.vocab_size, min_len=2))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def logits_of_every_step(llm: LLM, prompts, max_tokens: int) -> list[torch.Tensor]:
    """The logits of every step while ``llm`` serves ``prompts`` (greedy, ``max_tokens`` each)."""
    logits, execute = [], llm.runner.execute
    llm.runner.execute = lambda inputs: logits.append(execute(inputs)) or logits[-1]
    serve(llm, prompts, [max_tokens] * len(prompts))
    return logits


@pytest.mark.parametrize("ckpt_name", ["tiny_llama_ckpt", "tiny_qwen2_ckpt", "odd_ckpt"])
def test_native_layers_give_the_python_layers_logits_bit_for_bit(ckpt_name, request):
    """Decode-sized steps run every decoder layer as one C call (``engine/native_layers.py``): the
    kernels of the Python layers in the same order, so every step's logits equal the Python path's
    exactly: prefill steps of up to ``max_rows`` rows and decode steps in C, a larger prefill in Python."""
    ckpt = request.getfixturevalue(ckpt_name)
    in_c, in_python = build(ckpt, attention="cpu_paged"), build(ckpt, attention="cpu_paged")
    in_python.model.use_native_layers(None)
    layers = in_c.model.native_layers
    assert layers is not None and layers.max_rows == in_c.skinny_gemm_max_rows
    calls, forward = [], layers.forward
    layers.forward = lambda hidden, *args: calls.append(hidden.shape[0]) or forward(hidden, *args)
    vocab = in_c.model_config.vocab_size
    for prompts in (ragged_prompts(5, 7, vocab), ragged_prompts(6, 8, vocab, min_len=25, max_len=30)):
        calls.clear()
        expected = logits_of_every_step(in_python, prompts, max_tokens=6)
        got = logits_of_every_step(in_c, prompts, max_tokens=6)
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
        prompt_rows = sum(map(len, prompts))  # 107, then 219 (> max_rows: the Python layers)
        assert calls == ([prompt_rows] if prompt_rows <= layers.max_rows else []) + [len(prompts)] * 5


def test_native_layers_need_every_linear_in_c_and_a_backend_that_offers_its_kernel(tiny_llama_ckpt):
    llm = build(tiny_llama_ckpt, attention="cpu_paged_cascade")
    layers = llm.model.native_layers
    assert layers is not None and layers.can_run(1, llm.attention, DECODE_METADATA)  # the cascade backend passes its plan to C
    assert not layers.can_run(1, build(tiny_llama_ckpt, attention="eager").attention, DECODE_METADATA)  # a gather backend: Python layers
    assert layers.can_run(layers.max_rows, build(tiny_llama_ckpt, attention="cpu_paged").attention, DECODE_METADATA)
    assert not layers.can_run(layers.max_rows + 1, build(tiny_llama_ckpt, attention="cpu_paged").attention, DECODE_METADATA)
    assert build(tiny_llama_ckpt, attention="torch_sdpa").model.native_layers.can_run(1, TorchSDPABackend(), DECODE_METADATA) is False
    assert build(tiny_llama_ckpt, prepack=False).model.native_layers is None
    model = build(tiny_llama_ckpt, fused_ops=False).model
    assert model.native_layers is None
    model.layers[0].mlp.down_proj.skinny = None  # a linear without a C kernel: no C layers
    assert not NativeLayers.available(model)
    with pytest.raises(ValueError, match="no C kernel"):
        NativeLayers(model, FusedOps())


def test_fused_ops_options_and_missing_compiler(tiny_llama_ckpt, monkeypatch):
    with pytest.raises(ValueError, match="fused_ops"):
        build(tiny_llama_ckpt, fused_ops="yes")
    assert not build(tiny_llama_ckpt, dtype="bfloat16", fused_ops="auto").fused
    with pytest.raises(ValueError, match="float32"):
        build(tiny_llama_ckpt, dtype="bfloat16", fused_ops=True)
    monkeypatch.setenv("CC", "no-such-compiler-servelab")
    monkeypatch.setattr(native, "load", native.load.__wrapped__)  # skip the per-process cache
    with pytest.warns(UserWarning, match="no C compiler"):
        llm = build(tiny_llama_ckpt, fused_ops="auto")
    assert not llm.fused and llm.model.layers[0].mlp.gate_up_proj.skinny is None  # oneDNN packing stays
    assert llm.prepacked == onednn_linear_supported(torch.device("cpu"), torch.float32)
    with pytest.raises(native.NativeKernelUnavailable, match="no C compiler"):
        build(tiny_llama_ckpt, fused_ops=True, prepack=False)


def test_keep_freed_memory_option(tiny_llama_ckpt):
    """glibc malloc tuning (engine/host_memory.py): on by default for CPU runs where glibc exists,
    off on request; every other test of the suite runs with it on (outputs unchanged)."""
    import platform

    with pytest.raises(ValueError, match="keep_freed_memory"):
        build(tiny_llama_ckpt, keep_freed_memory="yes")
    assert build(tiny_llama_ckpt).kept_freed_memory == (platform.libc_ver()[0] == "glibc")
    assert not build(tiny_llama_ckpt, keep_freed_memory=False).kept_freed_memory


# -- runner: vectorised step preparation, no stale state across steps ----------------------------
def reference_prepare(scheduled, block_size: int):
    """The step description computed row by row in plain Python (the definition)."""
    ids, positions, slots, starts, qlens, rows = [], [], [], [], [], []
    for item in scheduled:
        seq = item.seq
        start = seq.num_tokens - 1 if item.is_padding else seq.num_computed_tokens
        for pos in range(start, start + item.num_new_tokens):
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        starts.append(start)
        qlens.append(item.num_new_tokens)
        if start + item.num_new_tokens == seq.num_tokens:
            rows.append(len(ids) - 1)
    return ids, positions, slots, [s + q for s, q in zip(starts, qlens)], qlens, rows


@pytest.mark.parametrize("chunked", [False, True])
def test_runner_metadata_equals_row_by_row_reference(tiny_llama_ckpt, chunked):
    llm = build(tiny_llama_ckpt, chunked_prefill=chunked, max_num_batched_tokens=24 if chunked else None)
    prompts = ragged_prompts(5, 10, llm.model_config.vocab_size, max_len=30)
    for index, prompt in enumerate(prompts[:6]):
        llm.add_request(prompt, SamplingParams(max_tokens=3 + index, ignore_eos=True))
    checked = decode_steps = 0
    late = iter(prompts[6:])
    while llm.has_unfinished():
        plan = llm.scheduler.schedule()
        if plan.is_empty:
            break
        inputs = llm.runner.prepare(plan.scheduled)
        ids, positions, slots, context_lens, qlens, rows = reference_prepare(plan.scheduled, llm.cache.block_size)
        meta = inputs.metadata
        assert inputs.input_ids.tolist() == ids
        assert inputs.positions.tolist() == positions
        assert meta.slot_mapping.tolist() == slots
        assert meta.context_lens.tolist() == context_lens
        assert meta.query_lens.tolist() == qlens
        assert meta.query_start_loc.tolist() == [sum(qlens[:i]) for i in range(len(qlens) + 1)]
        assert inputs.logits_indices.tolist() == rows
        assert meta.max_query_len == max(qlens) and meta.max_context_len == max(context_lens)
        for b, item in enumerate(plan.scheduled):
            table = item.seq.block_table
            assert meta.block_tables[b, : len(table)].tolist() == table
        checked += 1
        decode_steps += meta.is_decode_only
        # finish the step through the engine's own bookkeeping
        logits = llm.runner.execute(inputs)
        tokens = llm.sampler(logits, [item.seq for item in inputs.sampled])
        now = llm.clock()
        for item in plan.scheduled:
            if not item.is_padding:
                item.seq.num_computed_tokens += item.num_new_tokens
                llm.cache.on_tokens_computed(item.seq)
        finished = [item.seq for item, token in zip(inputs.sampled, tokens) if llm.append_token(item.seq, token, now)]
        llm.scheduler.retire(finished)
        if checked % 3 == 0:
            prompt = next(late, None)
            if prompt is not None:
                llm.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    assert checked > 5 and decode_steps > 0
    llm.free_blocks_check()


@pytest.mark.parametrize("attention", ["torch_sdpa", "eager"])
def test_back_to_back_workloads_equal_fresh_engines(tiny_llama_ckpt, attention):
    """Reused buffers (runner aranges, packed weights, per-step caches) leak nothing between runs."""
    first = ragged_prompts(10, 8, 256, max_len=25)
    second = ragged_prompts(11, 3, 256, min_len=20, max_len=40)  # fewer, longer: other shapes
    budgets_1, budgets_2 = [5, 9, 2, 14, 7, 3, 11, 6], [13, 1, 8]
    reused = build(tiny_llama_ckpt, attention=attention)
    got_1 = serve(reused, first, budgets_1)
    got_2 = serve(reused, second, budgets_2)
    got_1_again = serve(reused, first, budgets_1)
    assert got_1 == serve(build(tiny_llama_ckpt, attention=attention), first, budgets_1) == got_1_again
    assert got_2 == serve(build(tiny_llama_ckpt, attention=attention), second, budgets_2)


def test_runner_arange_cache_grows(tiny_llama_ckpt):
    runner: ModelRunner = build(tiny_llama_ckpt).runner
    assert runner._arange(5).tolist() == [0, 1, 2, 3, 4]
    big = runner._arange(5000)
    assert big.shape == (5000,) and torch.equal(big, torch.arange(5000))


# -- CUDA graphs --------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("attention", ["torch_sdpa", "eager"])
def test_cuda_graphs_tokens_equal_eager(tiny_llama_ckpt, attention):
    options = dict(device="cuda", attention=attention)
    graphs, eager = build(tiny_llama_ckpt, cuda_graphs=True, **options), build(tiny_llama_ckpt, **options)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    prompts = ragged_prompts(7, 7, 256, max_len=30)
    budgets = [12, 3, 20, 7, 1, 16, 9]  # batch shrinks 7 -> 1 through padded buckets 8, 4, 2, 1
    assert serve(graphs, prompts, budgets) == serve(eager, prompts, budgets)
    assert graphs.runner.graphs.graphs  # something was captured and replayed


def test_cuda_graphs_ignored_on_cpu(tiny_llama_ckpt):
    assert build(tiny_llama_ckpt, cuda_graphs=True).runner.graphs is None


# -- roofline ------------------------------------------------------------------------------------
def test_roofline_counts_and_decode_timing(tiny_llama_ckpt):
    """The bound's byte and FLOP counts equal the model's parameter, KV and attention arithmetic;
    a timed decode step and the machine probes (small sizes) give positive numbers."""
    from experiments.bench.roofline import decode_cost, measure_bandwidth, measure_matmul_peak, time_decode_steps

    llm = build(tiny_llama_ckpt, capacity_tokens=1024)
    config = llm.model_config
    cost = decode_cost(llm.model, config, batch=4, context=10, dtype=torch.float32)
    params = sum(p.numel() for p in llm.model.parameters())
    assert cost.weight_bytes == params * 4
    kv = 2 * config.num_hidden_layers * 4 * 10 * config.num_key_value_heads * config.head_dim
    assert cost.kv_bytes == kv * 4
    norms = sum(p.numel() for n, p in llm.model.named_parameters() if "norm" in n)
    attention = 4 * 4 * 10 * config.num_attention_heads * config.head_dim * config.num_hidden_layers
    assert cost.flops == 2 * 4 * (params - norms) + attention  # tied head: the embedding is the LM head
    assert time_decode_steps(llm, batch=3, context=6, steps=2) > 0
    llm.free_blocks_check()
    cpu = torch.device("cpu")
    assert all(rate > 0 for rate in measure_bandwidth(cpu, megabytes=4, repeats=1))  # copy, read bytes/s
    assert measure_matmul_peak(cpu, torch.float32, size=64, repeats=1) > 0  # torch.mm, oneDNN, skinny GEMM


# -- mixed steps attended per run of decode / prefill sequences -----------------------------------
def serve_with_late_arrivals(llm: LLM, prompts, budgets) -> list[list[int]]:
    """Three requests first, then one more before every step: most steps mix decodes and prompts."""
    pending = iter(range(len(prompts)))
    ids: dict[int, int] = {}

    def arrive() -> None:
        index = next(pending, None)
        if index is not None:
            ids[llm.add_request(prompts[index], SamplingParams(max_tokens=budgets[index], ignore_eos=True))] = index

    for _ in range(3):
        arrive()
    got: dict[int, list[int]] = {}
    while llm.has_unfinished():
        arrive()
        for output in llm.step():
            if output.finished:
                got[ids[output.request_id]] = output.token_ids
    llm.free_blocks_check()
    return [got[i] for i in range(len(prompts))]


@pytest.mark.parametrize("attention", ["torch_sdpa", "eager"])
def test_split_mixed_steps_equal_unsplit_and_hf(tiny_llama_ckpt, attention):
    split, whole = build(tiny_llama_ckpt, attention=attention), build(tiny_llama_ckpt, attention=attention)
    whole.runner.min_decode_run = None  # one padded attention call per layer
    used = []
    original = split.runner.split_runs
    split.runner.split_runs = lambda *args: used.append(original(*args)) or used[-1]
    prompts = ragged_prompts(21, 12, 256, max_len=24)
    budgets = [9, 3, 12, 5, 7, 1, 10, 4, 6, 8, 2, 11]
    tokens = serve_with_late_arrivals(split, prompts, budgets)
    assert any(parts is not None and len(parts) >= 2 for parts in used)  # mixed steps were split
    assert tokens == serve_with_late_arrivals(whole, prompts, budgets)
    for prompt, budget, generated in zip(prompts, budgets, tokens):
        assert generated == hf_greedy(str(tiny_llama_ckpt), tuple(prompt), budget)


def test_mixed_steps_run_whole_layers_in_c_with_cpu_paged(tiny_llama_ckpt):
    """``cpu_paged`` attends a mixed step's decode rows and prompt chunks in one unpadded call, so
    such steps (which the runner splits into runs for padded backends) take the C layers too, with
    every step's logits bit for bit the Python layers'."""
    in_c, in_python = build(tiny_llama_ckpt, attention="cpu_paged"), build(tiny_llama_ckpt, attention="cpu_paged")
    in_python.model.use_native_layers(None)
    layers = in_c.model.native_layers
    mixed_calls, forward = [], layers.forward
    layers.forward = lambda hidden, positions, kv, metadata, *rest: (
        mixed_calls.append(metadata.max_query_len > 1 and int((metadata.query_lens == 1).sum()) > 0)
        or forward(hidden, positions, kv, metadata, *rest))
    logits = []
    for llm in (in_c, in_python):
        step_logits, execute = [], llm.runner.execute
        llm.runner.execute = lambda inputs, execute=execute, step_logits=step_logits: step_logits.append(execute(inputs)) or step_logits[-1]
        prompts = ragged_prompts(21, 8, llm.model_config.vocab_size, max_len=24)
        serve_with_late_arrivals(llm, prompts, [9, 3, 12, 5, 7, 1, 10, 4])
        logits.append(step_logits)
    assert any(mixed_calls)  # mixed steps ran in C
    assert len(logits[0]) == len(logits[1]) and all(torch.equal(a, b) for a, b in zip(*logits))


def test_split_runs_metadata_slices(tiny_llama_ckpt):
    """Each run's metadata is the step's metadata restricted to its sequences, rows rebased to 0."""
    llm = build(tiny_llama_ckpt)
    for prompt in ragged_prompts(30, 3, 256, min_len=5, max_len=9):
        llm.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    llm.step()  # prefill the first three
    for prompt in ragged_prompts(31, 2, 256, min_len=6, max_len=9):
        llm.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    inputs = llm.runner.prepare(llm.scheduler.schedule().scheduled)
    meta = inputs.metadata
    assert inputs.attention_parts is not None and len(inputs.attention_parts) == 2
    (r0, r1, decode), (r2, r3, prefill) = inputs.attention_parts
    assert (r0, r1, r2) == (0, 3, 3) and r3 == meta.slot_mapping.shape[0]
    assert decode.is_decode_only and decode.query_start_loc.tolist() == [0, 1, 2, 3]
    assert prefill.query_start_loc.tolist() == [q - 3 for q in meta.query_start_loc[3:].tolist()]
    assert torch.equal(torch.cat([decode.slot_mapping, prefill.slot_mapping]), meta.slot_mapping)
    assert torch.equal(torch.cat([decode.context_lens, prefill.context_lens]), meta.context_lens)
    assert prefill.max_query_len == meta.max_query_len
    assert max(decode.max_context_len, prefill.max_context_len) == meta.max_context_len
