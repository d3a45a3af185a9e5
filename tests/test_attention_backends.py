"""Every attention backend against a naive per-sequence reference, on shuffled paged caches.

Caches are filled with NaN everywhere except the cached context, so any read outside a
sequence's context (padding, stale slots, other sequences' blocks) shows up as NaN in the
output. The ``test_triton_kernel_*`` cases run natively on CUDA; on CPU they need Triton's
interpreter, which must be enabled before triton is first imported: ``tests/conftest.py``
sets ``TRITON_INTERPRET=1`` for the pytest session on machines without CUDA (only triton reads it).
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from native_builds import without_avx512
from engine.attention_metadata import AttentionMetadata
from engine.interfaces.attention import AttentionBackend
from strategies.attention.bf16_prompt_attention import PromptSplit
from strategies.attention.cpu_paged import KERNEL_NAMES, CpuPagedBackend
from strategies.attention.eager import EagerBackend
from strategies.attention.torch_sdpa import TorchSDPABackend

TRITON_PAGED_PY = Path(__file__).resolve().parents[1] / "strategies/attention/triton_paged.py"
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (tokens already cached, new tokens this step) per sequence
MIXED = [(0, 7), (9, 1), (13, 5), (0, 1), (30, 1), (5, 3)]  # prefill, decode, chunk-with-context
DECODE = [(3, 1), (17, 1), (0, 1), (31, 1)]
HEADS = [(4, 2), (2, 2), (6, 2)]  # (num_heads, num_kv_heads): GQA, MHA, group of 3


@dataclass
class Step:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float


def make_step(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
) -> Step:
    """Random step whose sequences own shuffled (non-contiguous) blocks of a NaN-filled cache (in
    ``cache_dtype``, default ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = [c + q for c, q in seqs]
    num_blocks_per_seq = [math.ceil(n / block_size) for n in ctx]
    num_blocks = sum(num_blocks_per_seq) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in num_blocks_per_seq:
        tables.append(perm[used : used + n])
        used += n
    max_blocks = max(num_blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)

    def slot(i: int, t: int) -> int:
        return tables[i][t // block_size] * block_size + t % block_size

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype or dtype)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype or dtype)
    for i, (cached, _) in enumerate(seqs):
        for t in range(cached):
            k_cache.view(-1, num_kv_heads, head_dim)[slot(i, t)] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache.view(-1, num_kv_heads, head_dim)[slot(i, t)] = torch.randn(num_kv_heads, head_dim, generator=gen)

    query_lens = [q for _, q in seqs]
    num_tokens = sum(query_lens)
    slot_mapping = [slot(i, t) for i, (c, q) in enumerate(seqs) for t in range(c, c + q)]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32),
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        block_tables=block_tables,
        block_size=block_size,
        max_query_len=max(query_lens),
        max_context_len=max(ctx),
    )
    return Step(
        query=torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype),
        key=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype),
        value=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        metadata=metadata,
        scale=head_dim**-0.5,
    )


def reference(step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Naive float64 attention, one sequence and one head at a time: (out, k_cache, v_cache)."""
    md = step.metadata
    num_kv_heads, head_dim = step.k_cache.shape[-2:]
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    for row, s in enumerate(md.slot_mapping.tolist()):
        k_flat[s], v_flat[s] = step.key[row], step.value[row]

    num_heads = step.query.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(step.query.shape, dtype=torch.float64)
    for i in range(md.num_seqs):
        start, ctx, q_len = int(md.query_start_loc[i]), int(md.context_lens[i]), int(md.query_lens[i])
        table = md.block_tables[i].tolist()
        slots = [table[t // md.block_size] * md.block_size + t % md.block_size for t in range(ctx)]
        keys, values = k_flat[slots].double(), v_flat[slots].double()
        for j in range(q_len):
            pos = ctx - q_len + j
            for h in range(num_heads):
                q = step.query[start + j, h].double()
                scores = keys[: pos + 1, h // group] @ q * step.scale
                probs = torch.softmax(scores, dim=0)
                out[start + j, h] = probs @ values[: pos + 1, h // group]
    return out, k_cache, v_cache


def check_backend(backend: AttentionBackend, step: Step, atol: float = 1e-5, device: str = "cpu") -> None:
    expected, k_expected, v_expected = reference(step)
    md = step.metadata
    moved = AttentionMetadata(
        **{f: getattr(md, f).to(device) if isinstance(getattr(md, f), torch.Tensor) else getattr(md, f)
           for f in md.__dataclass_fields__}
    )
    k_cache, v_cache = step.k_cache.to(device), step.v_cache.to(device)
    out = backend.forward(
        step.query.to(device), step.key.to(device), step.value.to(device), k_cache, v_cache, moved, step.scale
    )
    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=atol)
    # new K/V landed in their slots and nothing else in the cache changed (NaNs included)
    torch.testing.assert_close(k_cache.cpu(), k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), v_expected, atol=0, rtol=0, equal_nan=True)


# ---------------------------------------------------------------- CPU backends (torch gathers, C kernel)

GATHER_BACKENDS = [EagerBackend, TorchSDPABackend]
CPU_BACKENDS = GATHER_BACKENDS + [CpuPagedBackend]


@pytest.mark.parametrize("backend_cls", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_cpu_backends_match_reference(backend_cls, block_size, heads, seqs) -> None:
    check_backend(backend_cls(), make_step(seqs, block_size, *heads, head_dim=16))


def test_cpu_paged_reads_strided_qkv_views_and_long_contexts() -> None:
    """In the model q/k/v are views of one fused qkv output; contexts span many key tiles and a
    work item holds several query tokens (prefill of 70 rows), with 14 query heads on 2 KV heads."""
    step = make_step([(300, 1), (0, 70), (40, 9)], 16, 14, 2, head_dim=64)
    fused = torch.cat([step.query, step.key, step.value], dim=1)  # [T, 14 + 2 + 2, D]
    query, key, value = fused.split([14, 2, 2], dim=1)
    assert not query.is_contiguous()
    step.query, step.key, step.value = query, key, value
    check_backend(CpuPagedBackend(), step)


def cpu_paged_builds(tmp_path) -> dict[str, CpuPagedBackend]:
    """``cpu_paged`` as the engine builds it (``-march=native``) and, on x86, its kernel built
    without AVX-512: 8 lanes and a register tile of 2 query vectors instead of 16 lanes and 4, the
    code the project's AVX2 machines run, which an AVX-512 machine would otherwise never test."""
    builds = {"native": CpuPagedBackend()}
    backend = CpuPagedBackend()
    entry_points = {f"_{name}": name for name in KERNEL_NAMES.values()}
    if without_avx512(backend, "paged_attention.c", entry_points, tmp_path) is not None:
        builds["no_avx512"] = backend
    return builds


def test_cpu_paged_register_tiles_and_edges(tmp_path) -> None:
    """Both builds over what the kernel's tiling must get right: query heads per KV head of 1-7
    (register tiles of up to 4 (2) queries, and their remainders), head_dim a multiple of the
    vector width or not (the rest one dim at a time), contexts across the 256-key softmax chunk
    (255-257 keys, 600 keys), decode rows and prefill chunks with their causal mask."""
    shapes = [((4, 4), 16), ((6, 2), 64), ((14, 2), 64), ((8, 2), 12), ((5, 1), 20), ((9, 3), 80)]
    seqs = [(254, 1), (255, 1), (256, 1), (600, 1), (0, 9), (250, 12)]
    for name, backend in cpu_paged_builds(tmp_path).items():
        for (num_heads, num_kv_heads), head_dim in shapes:
            step = make_step(seqs, 16, num_heads, num_kv_heads, head_dim=head_dim, seed=head_dim)
            check_backend(backend, step)


def test_cpu_paged_over_a_bfloat16_cache(tmp_path) -> None:
    """``kv_cache_dtype=bfloat16``: both builds write the new K/V rounded exactly as torch rounds
    them (``check_backend``'s cache comparison: bit for bit, every other slot untouched, NaNs
    included), attend within float32 tolerance of the float64 reference over those bf16 K/V, and
    give bit for bit the float32 kernel's output over a float32 cache holding the same rounded
    values (the arithmetic is float32 in both; only the loads widen)."""
    shapes = [((4, 4), 16), ((14, 2), 64), ((9, 3), 80)]
    seqs = [(255, 1), (256, 1), (600, 1), (0, 9), (250, 12), (3, 1)]
    for name, backend in cpu_paged_builds(tmp_path).items():
        for (num_heads, num_kv_heads), head_dim in shapes:
            step = make_step(seqs, 16, num_heads, num_kv_heads, head_dim=head_dim, seed=head_dim, cache_dtype=torch.bfloat16)
            check_backend(backend, step)
            md = step.metadata
            out16 = backend.forward(step.query, step.key, step.value, step.k_cache.clone(), step.v_cache.clone(), md, step.scale)
            out32 = backend.forward(step.query, step.key.bfloat16().float(), step.value.bfloat16().float(),
                                    step.k_cache.float(), step.v_cache.float(), md, step.scale)
            assert torch.equal(out16, out32), name


def test_cpu_paged_bf16_prompt_attention() -> None:
    """``use_bf16_prompt_attention``: over a bfloat16 cache, the sequences the split takes (prompt
    chunks from the start and after a cached context, which need the offset causal mask, among decode
    rows and a short chunk) attend in bfloat16 within bfloat16 tolerance of the float64 reference;
    the sequences it leaves get bit for bit the C kernel's output; every new K/V is written once,
    rounded as torch rounds (``check_backend``'s cache comparison)."""
    seqs = [(0, 40), (9, 1), (30, 20), (5, 1), (0, 3), (100, 17), (2, 1)]
    split = PromptSplit(min_rows=4, min_context=1, min_pairs=64)
    taken = [split.takes(q, c + q) for c, q in seqs]
    assert taken == [True, False, True, False, False, True, False]
    step = make_step(seqs, 16, 9, 3, head_dim=64, seed=5, cache_dtype=torch.bfloat16)
    backend = CpuPagedBackend()
    backend.use_bf16_prompt_attention(split)
    check_backend(backend, step, atol=3e-2)
    md = step.metadata
    out = backend.forward(step.query, step.key, step.value, step.k_cache.clone(), step.v_cache.clone(), md, step.scale)
    md.step_cache.clear()
    kernel_out = CpuPagedBackend().forward(step.query, step.key, step.value, step.k_cache.clone(), step.v_cache.clone(),
                                           md, step.scale)
    for seq, flash in enumerate(taken):
        rows = slice(int(md.query_start_loc[seq]), int(md.query_start_loc[seq + 1]))
        assert torch.equal(out[rows], kernel_out[rows]) != flash, seq  # the bfloat16 rows really are another computation
    float32_step = make_step(seqs, 16, 9, 3, head_dim=64, seed=5)  # a float32 cache: the C kernel for every row
    assert torch.equal(backend.forward(float32_step.query, float32_step.key, float32_step.value, float32_step.k_cache,
                                       float32_step.v_cache, float32_step.metadata, float32_step.scale),
                       CpuPagedBackend().forward(float32_step.query, float32_step.key, float32_step.value,
                                                 float32_step.k_cache.clone(), float32_step.v_cache.clone(),
                                                 float32_step.metadata, float32_step.scale))


def test_cpu_paged_rejects_what_it_cannot_run() -> None:
    step = make_step(MIXED, 4, 4, 2, head_dim=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 on the CPU"):
        check_backend(CpuPagedBackend(), step)
    step = make_step(DECODE, 4, 4, 2, head_dim=512)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        check_backend(CpuPagedBackend(), step)
    step = make_step(DECODE, 4, 4, 2, head_dim=16, cache_dtype=torch.float16)
    with pytest.raises(ValueError, match="reads a KV cache of float32, bfloat16; the cache is torch.float16"):
        check_backend(CpuPagedBackend(), step)
    step = make_step(DECODE, 4, 4, 2, head_dim=16)
    step.v_cache = step.v_cache.bfloat16()
    with pytest.raises(ValueError, match="both KV caches on the CPU in one dtype"):
        check_backend(CpuPagedBackend(), step)


@pytest.mark.parametrize("backend_cls", GATHER_BACKENDS)
def test_gather_backends_half_precision(backend_cls) -> None:
    step = make_step(MIXED, 4, 4, 2, head_dim=16, dtype=torch.bfloat16)
    check_backend(backend_cls(), step, atol=3e-2)


seq_strategy = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=seq_strategy,
    decode_only=st.booleans(),
    block_size=st.sampled_from([1, 3, 4, 16]),
    heads=st.sampled_from(HEADS + [(4, 1)]),
    head_dim=st.sampled_from([4, 8, 16]),
    backend_cls=st.sampled_from(CPU_BACKENDS),
)
def test_cpu_backends_random_shapes(seqs, decode_only, block_size, heads, head_dim, backend_cls) -> None:
    if decode_only:
        seqs = [(cached, 1) for cached, _ in seqs]
    check_backend(backend_cls(), make_step(seqs, block_size, *heads, head_dim=head_dim))


# ---------------------------------------------------------------- triton


def load_triton_paged(module_name: str) -> ModuleType:
    """A private, freshly executed copy of ``triton_paged`` (sys.modules is left untouched)."""
    spec = importlib.util.spec_from_file_location(module_name, TRITON_PAGED_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


needs_kernel = pytest.mark.skipif(
    not (HAS_TRITON and (INTERPRETING or torch.cuda.is_available())),
    reason="needs triton, and CUDA or TRITON_INTERPRET=1 set before triton is imported",
)


@needs_kernel
@pytest.mark.parametrize(
    "seqs, block_size, heads, head_dim",
    [
        (MIXED, 4, (4, 2), 16),
        (MIXED, 16, (2, 2), 8),  # MHA, head_dim padded to 16 inside the kernel
        (MIXED, 5, (6, 2), 16),  # block size not a power of two, group of 3
        (DECODE, 4, (4, 2), 16),
        (DECODE, 16, (6, 2), 8),
        ([(40, 24)], 4, (4, 1), 16),  # long chunk with context: several query tiles and key tiles
    ],
    ids=["mixed-bs4-gqa", "mixed-bs16-mha", "mixed-bs5-g3", "decode-bs4", "decode-bs16-g3", "chunk"],
)
def test_triton_kernel_matches_reference(seqs, block_size, heads, head_dim) -> None:
    from strategies.attention.triton_paged import TritonPagedBackend

    backend = TritonPagedBackend(block_m=16, block_n=16)
    check_backend(backend, make_step(seqs, block_size, *heads, head_dim=head_dim), device=KERNEL_DEVICE)


@needs_kernel
def test_triton_kernel_half_precision() -> None:
    from strategies.attention.triton_paged import TritonPagedBackend

    step = make_step(MIXED, 4, 4, 2, head_dim=16, dtype=torch.float16)
    check_backend(TritonPagedBackend(), step, atol=5e-3, device=KERNEL_DEVICE)


@needs_kernel
def test_triton_kernel_rejects_bad_tiles() -> None:
    from strategies.attention.triton_paged import TritonPagedBackend

    with pytest.raises(ValueError, match="block_n"):
        TritonPagedBackend(block_n=24)


@needs_kernel
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 6)), min_size=1, max_size=3),
    block_size=st.sampled_from([1, 3, 4, 16]),
    heads=st.sampled_from(HEADS + [(4, 1)]),
)
def test_triton_kernel_random_shapes(seqs, block_size, heads) -> None:
    from strategies.attention.triton_paged import TritonPagedBackend

    step = make_step(seqs, block_size, *heads, head_dim=8)
    check_backend(TritonPagedBackend(block_m=16, block_n=16), step, device=KERNEL_DEVICE)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel compiles natively here")
def test_triton_paged_without_interpreter_says_what_to_set(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as if the variable were missing at import
    module = load_triton_paged("_triton_paged_compiled")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        module.TritonPagedBackend()


def test_triton_paged_imports_without_triton(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    module = load_triton_paged("_triton_paged_missing")
    with pytest.raises(ImportError, match="pip install"):
        module.TritonPagedBackend()
