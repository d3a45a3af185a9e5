"""Swap preemption: K/V copied to host memory and back, byte for byte, into different blocks.

Cache level: every cache built on PagedCache swaps (paged, prefix, contiguous); a full host pool
refuses (the scheduler then recomputes); a swapped-out copy is dropped by ``free``.
Engine level: the swap parity cases live in test_strategy_matrix.py; here, the start-up errors.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.interfaces.scheduler import SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from strategies.cache.contiguous import ContiguousCache
from strategies.cache.paged import PagedCache
from strategies.cache.prefix import PrefixCache
from strategies.scheduler.preemptive import PreemptiveScheduler

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4


def make_cache(kind, capacity_tokens: int = 32, swap_tokens: int = 16):
    cache = kind(block_size=4, capacity_tokens=capacity_tokens)
    cache.bind_model_limits(16)
    cache.allocate_tensors(LAYERS, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    cache.enable_swap(swap_tokens)
    return cache


def computed(cache, prompt: list[int], seq_id: int = 0) -> Sequence:
    """A sequence whose prompt is computed: every slot's K/V holds a value unique to (layer, token)."""
    seq = Sequence(seq_id, prompt, SamplingParams(max_tokens=4), arrival_time=0.0)
    assert cache.admit(seq, seq.num_tokens)
    for token in range(seq.num_computed_tokens, seq.num_tokens):
        slot = seq.block_table[token // 4] * 4 + token % 4
        for layer, (k, v) in enumerate(cache.kv_caches):
            k.view(-1, KV_HEADS, HEAD_DIM)[slot] = 1000 * layer + prompt[token]
            v.view(-1, KV_HEADS, HEAD_DIM)[slot] = -1000 * layer - prompt[token]
    seq.num_computed_tokens = seq.num_tokens
    cache.on_tokens_computed(seq)
    return seq


def kv_of(cache, seq: Sequence) -> list[torch.Tensor]:
    slots = [seq.block_table[t // 4] * 4 + t % 4 for t in range(seq.num_computed_tokens)]
    return [t.view(-1, KV_HEADS, HEAD_DIM)[slots].clone() for pair in cache.kv_caches for t in pair]


@pytest.mark.parametrize("kind", [PagedCache, PrefixCache, ContiguousCache])
def test_swap_out_and_in_restores_kv_in_new_blocks(kind):
    cache = make_cache(kind)
    seq = computed(cache, list(range(20, 30)))  # 10 tokens: 3 blocks
    before, blocks_before = kv_of(cache, seq), list(seq.block_table)
    assert cache.swap_out(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and cache.is_swapped_out(seq)
    assert cache.stats().reserved_tokens == 0 and cache.stats().swap_used_blocks == 3
    # someone else takes (and overwrites) the freed blocks, so the copy-back must land elsewhere
    other = computed(cache, list(range(100, 100 + len(blocks_before) * 4 - 1)), seq_id=1)
    assert cache.num_cached_prefix_tokens(seq) == 10
    assert cache.admit(seq, 11)
    assert seq.num_computed_tokens == 10 and not cache.is_swapped_out(seq)
    assert set(seq.block_table).isdisjoint(other.block_table)
    for restored, original in zip(kv_of(cache, seq), before):
        assert torch.equal(restored, original)
    stats = cache.stats()
    block_bytes = 2 * LAYERS * 4 * KV_HEADS * HEAD_DIM * 4
    copied_back = 1 if kind is PrefixCache else 3  # the prefix cache re-shares its 2 published blocks
    assert (stats.swap_out_blocks, stats.swap_in_blocks, stats.swap_used_blocks) == (3, copied_back, 0)
    assert stats.swap_out_bytes == 3 * block_bytes and stats.swap_in_bytes == copied_back * block_bytes
    assert stats.swap_time_s > 0
    cache.free(seq)
    cache.free(other)
    cache.pool.check_all_free()


def test_prefix_hits_are_not_copied_back():
    cache = make_cache(PrefixCache)
    seq = computed(cache, list(range(20, 30)))  # publishes blocks 0 and 1 (8 tokens)
    assert cache.swap_out(seq)  # its published blocks stay cached (parked)
    assert cache.admit(seq, 11)
    assert seq.num_computed_tokens == 10
    assert cache.stats().swap_in_blocks == 1  # only the partial third block came from the host
    cache.free(seq)


def test_full_host_pool_refuses_and_changes_nothing():
    cache = make_cache(PagedCache, swap_tokens=12)  # 3 host blocks
    first = computed(cache, list(range(20, 30)))  # 3 blocks
    second = computed(cache, list(range(40, 45)), seq_id=1)  # 2 blocks
    assert cache.swap_out(first)
    table, stats = list(second.block_table), cache.stats()
    assert not cache.swap_out(second)  # no room: the scheduler recomputes instead
    assert second.block_table == table and second.num_computed_tokens == 5 and cache.stats() == stats


def test_free_drops_a_swapped_copy_and_double_free_still_raises():
    cache = make_cache(PagedCache)
    seq = computed(cache, list(range(20, 30)))
    assert cache.swap_out(seq)
    cache.free(seq)  # e.g. aborted while preempted
    assert cache.stats().swap_used_blocks == 0 and not cache.is_swapped_out(seq)
    with pytest.raises(RuntimeError, match="double free"):
        cache.free(seq)


def test_swap_space_must_hold_one_sequence(tiny_llama_ckpt):
    with pytest.raises(ValueError, match="cannot hold even one sequence of up to 24 tokens"):
        LLM(model=str(tiny_llama_ckpt), cache="paged", scheduler="preemptive", device="cpu", block_size=4,
            capacity_tokens=24, scheduler_options={"preemption_mode": "swap", "swap_space_tokens": 20})
    with pytest.raises(ValueError, match="at least one block"):
        PagedCache(block_size=4, capacity_tokens=16).enable_swap(3)


def test_unknown_preemption_mode_is_rejected_at_startup(tiny_llama_ckpt):
    with pytest.raises(ValueError, match="supported: recompute, swap"):
        LLM(model=str(tiny_llama_ckpt), scheduler="preemptive", device="cpu",
            scheduler_options={"preemption_mode": "spill"})


def test_scheduler_falls_back_to_recompute_when_the_host_pool_is_full():
    cache = PagedCache(block_size=4, capacity_tokens=32)
    cache.allocate_tensors(LAYERS, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    # max_model_len 12: the host pool must hold 12 tokens (3 blocks), exactly one long sequence
    scheduler = PreemptiveScheduler(cache, max_model_len=12, preemption_mode="swap", swap_space_tokens=12)
    first, second = computed(cache, list(range(20, 30))), computed(cache, list(range(40, 45)), seq_id=1)
    scheduler.running = [first, second]
    output = SchedulerOutput()
    scheduler.preempt(second, output)  # 2 blocks: swapped
    scheduler.preempt(first, output)  # 3 more blocks do not fit the 3-block pool: recomputed
    assert cache.is_swapped_out(second) and not cache.is_swapped_out(first)
    assert first.num_computed_tokens == 0 and first.block_table == [] and cache.num_cached_prefix_tokens(first) == 0
    assert cache.num_cached_prefix_tokens(second) == 5
    assert [seq.seq_id for seq in scheduler.waiting] == [0, 1] and output.preempted == [second, first]
    scheduler.abort(second)  # an aborted swapped-out request releases its host blocks
    assert cache.stats().swap_used_blocks == 0
    cache.pool.check_all_free()


def test_swap_enabled_before_the_tensors_exist():
    """The engine builds the scheduler (which enables swap) before allocating the K/V tensors."""
    cache = PagedCache(block_size=4, capacity_tokens=32)
    cache.enable_swap(16)
    cache.allocate_tensors(LAYERS, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    seq = computed(cache, list(range(20, 30)))
    before = kv_of(cache, seq)
    assert cache.swap_out(seq) and cache.admit(seq, 11)
    assert all(torch.equal(a, b) for a, b in zip(kv_of(cache, seq), before))
    assert cache.stats().swap_out_bytes == 3 * 2 * LAYERS * 4 * KV_HEADS * HEAD_DIM * 4
