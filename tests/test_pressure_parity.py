"""Parity under memory pressure: every cache x scheduler x cheap attention backend on a pool
squeezed until requests queue on memory, the preemptive scheduler preempts and the prefix cache
evicts (each asserted from the engine's own counters), and the tokens still equal HF greedy.
Seeded sampling draws the same tokens with and without recompute preemption.

The roomy matrix (test_strategy_matrix.py) proves the strategies compute the right thing; this
one proves they still do when memory runs out, which is when their bookkeeping is exercised.
"""
from __future__ import annotations

import itertools
import random

import pytest

from engine import LLM, SamplingParams
from engines import build_engine
from hf_reference import hf_greedy

CACHES = ["contiguous", "paged", "prefix"]
SCHEDULERS = ["static", "continuous", "preemptive"]
CHEAP_ATTENTIONS = ["torch_sdpa", "eager", "cpu_paged"]
BLOCK_SIZE = 4
MAX_NUM_SEQS = 4
# Pools: 10 blocks of 4 for the paged caches (each request needs 4-6 blocks at its longest, so
# at most two worst cases fit and four growing requests run dry); two max_model_len (256) regions
# for the contiguous cache, with four batch slots.
CAPACITY = {"contiguous": 512, "paged": 40, "prefix": 40}

_rng = random.Random(11)
_SHARED = [_rng.randrange(3, 256) for _ in range(8)]  # two full blocks every other prompt starts with


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, 256) for _ in range(n)]


# (prompt, max_tokens, step at which it arrives)
WORKLOAD = [
    (_SHARED + _tokens(3), 9, 0),
    (_tokens(6), 10, 0),
    (_SHARED + _tokens(2), 8, 0),
    (_tokens(9), 12, 1),
    (_SHARED + _tokens(1), 7, 3),
    (_tokens(5), 11, 4),
    (_SHARED + _tokens(4), 6, 6),
]


def squeezed(ckpt, cache: str, scheduler: str, attention: str = "torch_sdpa", capacity: int | None = None) -> LLM:
    return build_engine(ckpt, cache, scheduler, attention,
                        cache_options={"block_size": BLOCK_SIZE, "capacity_tokens": capacity or CAPACITY[cache]},
                        scheduler_options={"max_num_seqs": MAX_NUM_SEQS})


def count_memory_refusals(llm: LLM) -> list[int]:
    """Wrap the cache's ``admit`` to count admissions refused for lack of memory."""
    refusals = [0]
    admit = llm.cache.admit

    def counting_admit(seq, num_tokens):
        admitted = admit(seq, num_tokens)
        refusals[0] += not admitted
        return admitted

    llm.cache.admit = counting_admit
    return refusals


def run(llm: LLM, params_for) -> list[list[int]]:
    """WORKLOAD with its late arrivals (bounded); generated tokens in workload order."""
    ids: dict[int, int] = {}
    outputs: dict[int, list[int]] = {}
    for step in range(1000):
        for index, (prompt, max_tokens, arrival_step) in enumerate(WORKLOAD):
            if arrival_step == step:
                ids[llm.add_request(prompt, params_for(index, max_tokens))] = index
        outputs.update({ids[o.request_id]: o.token_ids for o in llm.step() if o.finished})
        if len(outputs) == len(WORKLOAD):
            break
    assert len(outputs) == len(WORKLOAD) and not llm.has_unfinished(), "workload did not finish"
    llm.free_blocks_check()
    return [outputs[index] for index in range(len(WORKLOAD))]


def greedy(index: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def seeded(index: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=60, top_p=0.9, seed=500 + index, ignore_eos=True)


def check_pressure_parity(ckpt, cache: str, scheduler: str, attention: str) -> None:
    llm = squeezed(ckpt, cache, scheduler, attention)
    refusals = count_memory_refusals(llm)
    tokens = run(llm, greedy)
    for (prompt, max_tokens, _), generated in zip(WORKLOAD, tokens):
        assert generated == hf_greedy(str(ckpt), tuple(prompt), max_tokens)
    records = llm.step_records
    stats = llm.cache.stats()
    assert refusals[0] > 0, "no request ever queued on memory: the pool is not squeezed"
    assert max(r.kv_reserved_tokens for r in records) <= CAPACITY[cache]
    preemptions = sum(r.num_preempted for r in records)
    if scheduler == "preemptive" and cache != "contiguous":  # contiguous regions never run dry
        assert preemptions > 0
    else:
        assert preemptions == 0
    if cache == "prefix":
        assert stats.prefix_hit_tokens > 0 and stats.prefix_evicted_blocks > 0
    llm.cache.pool.check_all_free()


@pytest.mark.parametrize("cache, scheduler, attention", list(itertools.product(CACHES, SCHEDULERS, CHEAP_ATTENTIONS)))
def test_pressure_parity_matrix(tiny_llama_ckpt, cache, scheduler, attention):
    check_pressure_parity(tiny_llama_ckpt, cache, scheduler, attention)


@pytest.mark.slow  # the Triton interpreter runs the kernel in Python: minutes for the nine combinations
@pytest.mark.parametrize("cache, scheduler", list(itertools.product(CACHES, SCHEDULERS)))
def test_pressure_parity_triton(tiny_llama_ckpt, triton_available, cache, scheduler):
    if not triton_available:
        pytest.skip("triton is not installed")
    check_pressure_parity(tiny_llama_ckpt, cache, scheduler, "triton_paged")


@pytest.mark.parametrize("cache", ["paged", "prefix"])
def test_seeded_sampling_is_unchanged_by_recompute_preemption(tiny_llama_ckpt, cache):
    roomy = run(squeezed(tiny_llama_ckpt, "paged", "continuous", capacity=1024), seeded)
    llm = squeezed(tiny_llama_ckpt, cache, "preemptive")
    assert run(llm, seeded) == roomy
    assert sum(r.num_preempted for r in llm.step_records) > 0
    assert roomy != [hf_greedy(str(tiny_llama_ckpt), tuple(p), m) for p, m, _ in WORKLOAD], "it must really sample"
