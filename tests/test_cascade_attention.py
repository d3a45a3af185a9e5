"""Cascade (shared-prefix) attention: exact against the naive reference, and HF's tokens end to end.

Kernel level: decode steps whose sequences share physical prefix blocks (as a prefix cache
hands them out) in a NaN-filled cache, so a read outside a context shows up as NaN; the
cascade backend must match the float64 reference and must really take the cascade path
(``stats``). The C kernel's partial mode (key start + log-sum-exp) is checked on its own.
Engine level: cache=prefix with a 500-token shared prompt gives HF's greedy tokens.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.attention_metadata import AttentionMetadata
from hf_reference import hf_greedy
from strategies.attention.cpu_paged_cascade import CpuPagedCascadeBackend, plan_groups
from test_attention_backends import Step, check_backend


def shared_prefix_step(groups: list[tuple[int, list[int]]], block_size: int, num_heads: int, num_kv_heads: int,
                       head_dim: int, seed: int = 0, extra_prefill: int = 0) -> Step:
    """A decode step: ``groups`` = [(shared blocks, [own tokens of each member incl. the new one])].

    Blocks are shuffled; shared blocks appear once in the cache and in every member's table.
    ``extra_prefill`` > 0 appends a prefill sequence of that many tokens (a mixed step).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = 0
    for shared_blocks, members in groups:
        needed += shared_blocks + sum(-(-own // block_size) for own in members)
    needed += -(-extra_prefill // block_size) + 2
    ids = list(range(needed))
    rng.shuffle(ids)
    take = iter(ids)
    seqs = []  # (table, context, query_len)
    for shared_blocks, members in groups:
        shared = [next(take) for _ in range(shared_blocks)]
        for own in members:
            own_blocks = [next(take) for _ in range(-(-own // block_size))]
            seqs.append((shared + own_blocks, shared_blocks * block_size + own, 1))
    if extra_prefill:
        seqs.append(([next(take) for _ in range(-(-extra_prefill // block_size))], extra_prefill, extra_prefill))
    shape = (needed, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    slots = lambda table, t: table[t // block_size] * block_size + t % block_size  # noqa: E731
    for table, context, query_len in seqs:
        for t in range(context - query_len):
            if torch.isnan(k_flat[slots(table, t)]).any():  # shared slots are written once
                k_flat[slots(table, t)] = torch.randn(num_kv_heads, head_dim, generator=gen)
                v_flat[slots(table, t)] = torch.randn(num_kv_heads, head_dim, generator=gen)
    query_lens = [q for _, _, q in seqs]
    max_blocks = max(len(t) for t, _, _ in seqs)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32),
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        context_lens=torch.tensor([c for _, c, _ in seqs], dtype=torch.int32),
        slot_mapping=torch.tensor([slots(t, p) for t, c, q in seqs for p in range(c - q, c)], dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t, _, _ in seqs], dtype=torch.int32),
        block_size=block_size, max_query_len=max(query_lens), max_context_len=max(c for _, c, _ in seqs),
    )
    num_tokens = sum(query_lens)
    return Step(
        query=torch.randn(num_tokens, num_heads, head_dim, generator=gen),
        key=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen),
        value=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen),
        k_cache=k_cache, v_cache=v_cache, metadata=metadata, scale=head_dim ** -0.5,
    )


# a group of 3 sharing 4 blocks (one member's query token is the first of its own block), a group of
# 2 sharing 2 blocks, a loner whose "shared" blocks nobody else holds
GROUPS = [(4, [3, 1, 6]), (2, [2, 5]), (3, [1])]


@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_cascade_matches_reference_and_takes_the_cascade_path(heads, block_size):
    backend = CpuPagedCascadeBackend(min_shared_tokens=1)
    check_backend(backend, shared_prefix_step(GROUPS, block_size, *heads, head_dim=16))
    assert backend.stats.cascade_calls == 1 and backend.stats.groups == 2
    assert backend.stats.shared_rows_saved == (2 * 4 + 1 * 2) * block_size


@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 2), 24), ((3, 1), 8)])
def test_cascade_at_model_shapes(heads, head_dim):
    """SmolLM2's heads (9 query on 3 KV heads, head_dim 64) and head_dims with a partial 16-dim tile;
    a 35-block prefix is more than two 256-key chunks of the kernel's online softmax, and 30 x 3
    query vectors per KV head fill five 16-lane tiles and part of a sixth; a second, smaller group
    shares a prefix of 5 blocks in the same step."""
    rng = random.Random(7)
    groups = [(35, [rng.randint(1, 40) for _ in range(30)]), (5, [rng.randint(1, 9) for _ in range(3)])]
    backend = CpuPagedCascadeBackend()
    check_backend(backend, shared_prefix_step(groups, 16, *heads, head_dim=head_dim, seed=1))
    assert backend.stats.cascade_calls == 1 and backend.stats.groups == 2


def test_groups_come_from_equal_leading_blocks():
    step = shared_prefix_step(GROUPS, 4, 4, 2, head_dim=8)
    plan = plan_groups(step.metadata, min_group_size=2, min_shared_tokens=1)
    assert [(g.num_rows, g.num_tokens) for g in plan.groups] == [(3, 16), (2, 8)]
    assert plan.kv_starts.tolist() == [16, 16, 16, 8, 8, 0]
    # thresholds: a 2-member group below min_shared_tokens, or groups below min_group_size, drop out
    assert [g.num_rows for g in plan_groups(step.metadata, 2, 12).groups] == [3]
    assert plan_groups(step.metadata, 4, 1).groups == []


def test_mixed_steps_and_small_groups_take_the_plain_path():
    backend = CpuPagedCascadeBackend(min_shared_tokens=1)
    check_backend(backend, shared_prefix_step(GROUPS, 4, 4, 2, head_dim=16, extra_prefill=7))
    check_backend(backend, shared_prefix_step([(3, [2]), (3, [4])], 4, 4, 2, head_dim=16))  # nobody shares
    assert backend.stats.cascade_calls == 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(1, 9), min_size=1, max_size=4)),
                    min_size=1, max_size=3),
    block_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(4, 2), (6, 3), (2, 1)]),
)
def test_cascade_random_shapes(groups, block_size, heads):
    check_backend(CpuPagedCascadeBackend(min_shared_tokens=1), shared_prefix_step(groups, block_size, *heads, head_dim=8))


def test_bad_options():
    with pytest.raises(ValueError, match="min_group_size must be >= 2"):
        CpuPagedCascadeBackend(min_group_size=1)
    with pytest.raises(ValueError, match="min_shared_tokens must be >= 1"):
        CpuPagedCascadeBackend(min_shared_tokens=0)


def test_engine_shared_prompt_gives_hf_tokens_through_the_cascade_path(long_context_ckpt):
    """cache=prefix + a 500-token shared prompt: later users share its 31 blocks; the cascade
    path runs in their decode steps, and every user's tokens equal HF greedy's and cpu_paged's."""
    rng = random.Random(3)  # prompts whose greedy tokens avoid EOS: HF's oracle suppresses EOS (min_new_tokens)
    shared = [rng.randrange(3, 256) for _ in range(500)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    prompts.append([rng.randrange(3, 256) for _ in range(40)])  # a user outside the group
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    tokens = {}
    for attention in ("cpu_paged", "cpu_paged_cascade"):
        llm = LLM(model=str(long_context_ckpt), cache="prefix", attention=attention, device="cpu",
                  block_size=16, capacity_tokens=4096)
        llm.generate(prompts[:1], SamplingParams(max_tokens=1, ignore_eos=True))  # publishes the shared blocks
        tokens[attention] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.free_blocks_check()
    stats = llm.attention.stats
    assert stats.cascade_calls > 0 and stats.groups >= stats.cascade_calls
    assert tokens["cpu_paged_cascade"] == tokens["cpu_paged"]
    for prompt, generated in zip(prompts, tokens["cpu_paged_cascade"]):
        assert generated == hf_greedy(str(long_context_ckpt), tuple(prompt), 4)


def test_engine_block_reused_for_another_prefix_gives_hf_tokens(long_context_ckpt, monkeypatch):
    """A pool of 4 blocks of 64 tokens: each round's shared 64-token prompt evicts an earlier one, so
    the same physical block id is the shared prefix of different rounds with different content
    (asserted); the cascade path groups each round's users over it and gives HF's tokens."""
    import strategies.attention.cpu_paged_cascade as cascade_module

    shared_blocks: list[tuple[int, ...]] = []
    plan = cascade_module.plan_groups

    def recording_plan(*args):
        result = plan(*args)
        shared_blocks.extend(g.blocks for g in result.groups)
        return result

    monkeypatch.setattr(cascade_module, "plan_groups", recording_plan)
    rng = random.Random(5)
    llm = LLM(model=str(long_context_ckpt), cache="prefix", attention="cpu_paged_cascade", device="cpu",
              block_size=64, capacity_tokens=4 * 64)
    first_blocks_per_round = []
    for _ in range(4):
        shared = [rng.randrange(3, 256) for _ in range(64)]
        prompts = [shared + [rng.randrange(3, 256) for _ in range(5)] for _ in range(3)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=1, ignore_eos=True))  # publishes the shared block
        shared_blocks.clear()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        for prompt, output in zip(prompts, outputs):
            assert output.token_ids == hf_greedy(str(long_context_ckpt), tuple(prompt), 4)
        first_blocks_per_round.append(set(shared_blocks))
    assert all(len(blocks) == 1 for blocks in first_blocks_per_round)  # one group per round
    assert len({b for blocks in first_blocks_per_round for b in blocks}) < 4  # a block id came back
    assert llm.attention.stats.cascade_calls > 0
    llm.free_blocks_check()


def test_engine_cascade_in_c_layers_gives_the_python_layers_logits_bit_for_bit(long_context_ckpt):
    """Decode steps with a shared prompt run the cascade kernel from whole decoder layers in C
    (``native_attention`` passes the step's plan through every layer's call): every step's logits
    equal the Python layers' exactly, and the C path really ran the cascade kernel (its calls
    counted one per layer)."""
    from test_optimizations import logits_of_every_step

    rng = random.Random(4)
    shared = [rng.randrange(3, 256) for _ in range(200)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(rng.randint(3, 9))] for _ in range(4)]
    runs = {}
    for name in ("c_layers", "python_layers"):
        llm = LLM(model=str(long_context_ckpt), cache="prefix", attention="cpu_paged_cascade", device="cpu",
                  block_size=16, capacity_tokens=4096)
        c_steps = []
        if name == "python_layers":
            llm.model.use_native_layers(None)
        else:
            layers = llm.model.native_layers
            forward = layers.forward
            layers.forward = lambda hidden, *args: c_steps.append(hidden.shape[0]) or forward(hidden, *args)
        llm.generate(prompts[:1], SamplingParams(max_tokens=1, ignore_eos=True))  # publishes the shared blocks
        llm.attention.stats = type(llm.attention.stats)()
        runs[name] = (logits_of_every_step(llm, prompts, max_tokens=5), llm.attention.stats)
        assert (c_steps.count(len(prompts)) == 4) == (name == "c_layers")  # the 4 decode steps ran in C
    (got, c_stats), (expected, python_stats) = runs["c_layers"], runs["python_layers"]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    assert c_stats == python_stats and c_stats.cascade_calls > 0
