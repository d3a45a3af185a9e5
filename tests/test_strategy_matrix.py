"""Every cache x scheduler x attention combination yields HF's greedy tokens.

One ragged workload with late arrivals, prompts and outputs crossing block boundaries
(block_size 4), run through the engine's add_request/step loop. triton_paged runs under the
Triton interpreter on the CPU (see conftest's ``triton_available``).
"""
from __future__ import annotations

import itertools
import random

import pytest

from engine import LLM, SamplingParams
from hf_reference import hf_greedy

CACHES = ["paged", "contiguous", "prefix"]
SCHEDULERS = ["static", "continuous", "preemptive"]
ATTENTIONS = ["torch_sdpa", "eager", "cpu_paged", "cpu_paged_cascade", "triton_paged"]

# (prompt, max_tokens, step at which it arrives); two prompts share a 9-token prefix.
_rng = random.Random(7)
_SHARED = [_rng.randrange(3, 256) for _ in range(9)]
WORKLOAD = [
    (_SHARED + [11, 12, 13], 7, 0),
    ([_rng.randrange(3, 256) for _ in range(5)], 3, 0),
    ([_rng.randrange(3, 256) for _ in range(1)], 9, 0),
    (_SHARED + [21, 22], 5, 2),
    ([_rng.randrange(3, 256) for _ in range(14)], 6, 3),
    ([_rng.randrange(3, 256) for _ in range(4)], 1, 5),
]


def run_workload(llm: LLM, params_for) -> list[list[int]]:
    """Feed WORKLOAD with its late arrivals; returns generated tokens in workload order."""
    ids: dict[int, int] = {}
    outputs: dict[int, list[int]] = {}
    step = 0
    while len(outputs) < len(WORKLOAD):
        for index, (prompt, max_tokens, arrival_step) in enumerate(WORKLOAD):
            if arrival_step == step:
                ids[llm.add_request(prompt, params_for(index, max_tokens))] = index
        for output in llm.step():
            if output.finished:
                outputs[ids[output.request_id]] = output.token_ids
        step += 1
        assert step < 500, "workload did not finish"
    assert not llm.has_unfinished()
    llm.free_blocks_check()
    return [outputs[index] for index in range(len(WORKLOAD))]


def build(ckpt, cache: str, scheduler: str, attention: str, **options) -> LLM:
    # contiguous reserves max_model_len (256) per sequence: room for 4 regions, as max_num_seqs
    options.setdefault("capacity_tokens", 1024 if cache == "contiguous" else 256)
    if attention == "cpu_paged_cascade":  # WORKLOAD's shared prefix is 2 blocks of 4 tokens
        options.setdefault("attention_options", {"min_shared_tokens": 4})
    return LLM(model=str(ckpt), cache=cache, scheduler=scheduler, attention=attention, device="cpu",
               max_num_seqs=4, block_size=4, **options)


COMBINATIONS = list(itertools.product(CACHES, SCHEDULERS, ATTENTIONS))


def seeded(index: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=50, top_p=0.9, seed=1000 + index,
                          ignore_eos=True)


@pytest.fixture(scope="module")
def seeded_reference(tiny_llama_ckpt) -> list[list[int]]:
    tokens = run_workload(build(tiny_llama_ckpt, "paged", "continuous", "torch_sdpa"), seeded)
    greedy = [hf_greedy(str(tiny_llama_ckpt), tuple(p), m) for p, m, _ in WORKLOAD]
    assert tokens != greedy, "sampling must actually sample"
    return tokens


@pytest.mark.parametrize("cache, scheduler, attention", COMBINATIONS)
def test_parity_matrix(tiny_llama_ckpt, triton_available, seeded_reference, cache, scheduler, attention):
    """Greedy tokens equal HF; seeded sampling equals the reference combination's tokens."""
    if attention == "triton_paged" and not triton_available:
        pytest.skip("triton is not installed")
    llm = build(tiny_llama_ckpt, cache, scheduler, attention)
    tokens = run_workload(llm, lambda index, max_tokens: SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for (prompt, max_tokens, _), generated in zip(WORKLOAD, tokens):
        assert generated == hf_greedy(str(tiny_llama_ckpt), tuple(prompt), max_tokens)
    if scheduler == "static":
        assert sum(r.num_wasted_slots for r in llm.step_records) > 0
    else:
        assert sum(r.num_wasted_slots for r in llm.step_records) == 0
    if attention == "cpu_paged_cascade":
        # prompts 0 and 3 decode side by side sharing 2 prefix blocks, unless static batching keeps
        # them apart; only the prefix cache hands out shared blocks
        assert (llm.attention.stats.cascade_calls > 0) == (cache == "prefix" and scheduler != "static")
    # the same engine, now sampling: batch composition and strategies must not matter
    assert run_workload(llm, seeded) == seeded_reference


@pytest.mark.parametrize("scheduler", ["continuous", "preemptive"])
@pytest.mark.parametrize("cache", ["paged", "prefix"])
def test_chunked_prefill_parity(tiny_llama_ckpt, cache, scheduler):
    llm = build(tiny_llama_ckpt, cache, scheduler, "torch_sdpa", chunked_prefill=True, max_num_batched_tokens=6)
    tokens = run_workload(llm, lambda index, max_tokens: SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for (prompt, max_tokens, _), generated in zip(WORKLOAD, tokens):
        assert generated == hf_greedy(str(tiny_llama_ckpt), tuple(prompt), max_tokens)
    records = llm.step_records
    assert max(r.num_prefill_tokens + r.num_decode_tokens for r in records) <= 6
    # chunks and decode tokens really shared forward passes
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in records)


def greedy_with_priority(index: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=index % 2)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("cache", ["paged", "prefix"])
def test_policy_and_preemption_mode_parity(tiny_llama_ckpt, cache, preemption_mode, policy):
    """A squeezed pool (6 blocks of 4 for up to 4 running sequences of up to 20 tokens): every
    policy and preemption mode preempts, and still yields HF's greedy tokens."""
    llm = build(tiny_llama_ckpt, cache, "preemptive", "cpu_paged", capacity_tokens=24, scheduler_options={
        "policy": policy, "sjf_aging_steps": 4, "preemption_mode": preemption_mode, "swap_space_tokens": 256})
    tokens = run_workload(llm, greedy_with_priority)
    for (prompt, max_tokens, _), generated in zip(WORKLOAD, tokens):
        assert generated == hf_greedy(str(tiny_llama_ckpt), tuple(prompt), max_tokens)
    records = llm.step_records
    assert sum(r.num_preempted for r in records) > 0
    swapped_out = sum(r.swap_out_blocks for r in records)
    prefill = sum(r.num_prefill_tokens for r in records)
    prompts = sum(len(prompt) for prompt, _, _ in WORKLOAD)
    if preemption_mode == "swap":
        assert swapped_out > 0 and sum(r.swap_out_bytes for r in records) > 0
    else:
        assert swapped_out == 0
    if cache == "paged":  # no prefix hits to blur the count
        if preemption_mode == "swap":  # the host pool never fills here: resumed, never recomputed
            assert prefill == prompts and sum(r.swap_in_blocks for r in records) == swapped_out
        else:  # recompute prefills prompt + generated tokens again
            assert prefill > prompts
