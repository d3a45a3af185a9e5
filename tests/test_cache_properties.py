"""Cache strategies under random admit / grow / compute / free / preempt traffic, plus unit cases.

The stateful tests drive each cache the way the schedulers and the engine do, with token ids
from a two-letter alphabet so that prompts share prefixes all the time, and check after every
step: no block outside the pool, no block held by two sequences unless it is a full, computed
prefix block with the same tokens at the same position, reference counts equal to the number of
holders, stats consistent, and — through a shadow copy of what every KV slot holds — that a
prefix hit hands out K/V computed from exactly the same prefix. At the end everything is freed
and the pool must be whole again.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from hydra.utils import instantiate
from omegaconf import OmegaConf

from engine.config import CONF_DIR
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.interfaces.cache import KVCacheStrategy
from strategies.cache.contiguous import ContiguousCache, FirstFitArena, ReservePolicy
from strategies.cache.paged import PagedCache
from strategies.cache.prefix import PrefixCache

ALPHABET = (5, 6)  # two token ids: prompts collide on prefixes often
SYSTEM_PROMPTS = ((), (5, 5, 5, 5), (5, 5, 5, 5, 6, 6, 6, 6), (6, 5, 6, 5, 6))  # shared starts, as in chat traffic
BLOCK = 4
CAPACITY = 48  # 12 blocks of 4: memory runs short, parked blocks get evicted
MAX_MODEL_LEN = 24  # >= longest prompt (8 + 7) + max_tokens (8); 2 contiguous regions fit
MAX_WAITING = 6


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id, list(prompt), SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


def compute(cache: KVCacheStrategy, seq: Sequence, num_tokens: int) -> None:
    """What the engine does after a step computed ``num_tokens`` of ``seq``."""
    seq.num_computed_tokens += num_tokens
    cache.on_tokens_computed(seq)


class CacheMachine(RuleBasedStateMachine):
    """Plays scheduler + engine against one cache; subclasses choose the cache."""

    def make_cache(self) -> KVCacheStrategy:
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self.cache = self.make_cache()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.next_id = 0
        # physical slot -> the token prefix whose K/V it holds (the last token's K/V depends on all of it)
        self.slot_contents: dict[int, tuple[int, ...]] = {}

    # -- traffic -------------------------------------------------------------------------------
    @precondition(lambda self: len(self.waiting) < MAX_WAITING)
    @rule(
        system=st.sampled_from(SYSTEM_PROMPTS),
        question=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=7),
        max_tokens=st.integers(1, 8),
    )
    def add_request(self, system: tuple[int, ...], question: list[int], max_tokens: int) -> None:
        self.waiting.append(make_seq(self.next_id, [*system, *question], max_tokens))
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, MAX_WAITING), worst_case=st.booleans())
    def admit(self, pick: int, worst_case: bool) -> None:
        """Admit like the schedulers: worst case (continuous, static) or this step only (preemptive)."""
        seq = self.waiting[pick % len(self.waiting)]
        num_cached = self.cache.num_cached_prefix_tokens(seq)
        assert num_cached % self.cache.block_size == 0 and 0 <= num_cached < seq.num_tokens
        stats_before = self.cache.stats()
        reservation = seq.max_total_tokens if worst_case else seq.num_tokens
        if not self.cache.admit(seq, reservation):
            assert seq.block_table == [] and self.cache.stats() == stats_before, "a refused admission changed state"
            return
        assert seq.num_computed_tokens == seq.num_cached_tokens == num_cached
        assert len(seq.block_table) * self.cache.block_size >= reservation
        for token in range(num_cached):  # a hit must hand out K/V of exactly this prefix
            assert self.slot_contents[self.slot(seq, token)] == tuple(seq.token_ids[: token + 1])
        self.waiting.remove(seq)
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 31), chunk=st.integers(1, 16))
    def compute_tokens(self, pick: int, chunk: int) -> None:
        """Grow for a prefill chunk or a decode token, then 'run the model' on it."""
        seq = self.running[pick % len(self.running)]
        num_new = min(chunk, seq.num_uncomputed_tokens)
        if num_new == 0:
            return
        table_before = list(seq.block_table)
        if not self.cache.grow(seq, seq.num_computed_tokens + num_new):
            assert seq.block_table == table_before, "a refused grow changed the block table"
            return
        for token in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            block = seq.block_table[token // self.cache.block_size]
            holders = [other for other in self.running if block in other.block_table]
            assert holders == [seq], f"writing into block {block} held by {[s.seq_id for s in holders]}"
            self.slot_contents[self.slot(seq, token)] = tuple(seq.token_ids[: token + 1])
        compute(self.cache, seq, num_new)

    @precondition(lambda self: any(s.num_uncomputed_tokens == 0 and s.num_output_tokens < s.sampling_params.max_tokens
                                   for s in self.running))
    @rule(pick=st.integers(0, 31), token=st.sampled_from(ALPHABET))
    def sample_token(self, pick: int, token: int) -> None:
        ready = [s for s in self.running if s.num_uncomputed_tokens == 0 and s.num_output_tokens < s.sampling_params.max_tokens]
        ready[pick % len(ready)].token_ids.append(token)

    @precondition(lambda self: any(s.num_uncomputed_tokens == 0 for s in self.running))
    @rule(pick=st.integers(0, 31))
    def finish(self, pick: int) -> None:
        """A sequence finishes after a step computed all its tokens (a stop token was sampled)."""
        done = [s for s in self.running if s.num_uncomputed_tokens == 0]
        seq = done[pick % len(done)]
        self.running.remove(seq)
        self.cache.free(seq)
        assert seq.block_table == []
        with pytest.raises(RuntimeError, match="double free"):
            self.cache.free(seq)

    @precondition(lambda self: self.running and len(self.waiting) < MAX_WAITING)
    @rule(pick=st.integers(0, 31))
    def preempt(self, pick: int) -> None:
        """Recompute preemption: free, forget computed tokens, back to the front of the queue."""
        seq = self.running.pop(pick % len(self.running))
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        self.waiting.insert(0, seq)

    # -- checks ------------------------------------------------------------------------------
    def slot(self, seq: Sequence, token: int) -> int:
        size = self.cache.block_size
        return seq.block_table[token // size] * size + token % size

    @invariant()
    def blocks_are_owned_or_shared_prefix(self) -> None:
        size = self.cache.block_size
        holders: dict[int, list[tuple[Sequence, int]]] = defaultdict(list)
        for seq in self.running:
            assert seq.num_computed_tokens <= min(seq.num_tokens, len(seq.block_table) * size)
            for index, block in enumerate(seq.block_table):
                assert 0 <= block < self.cache.num_blocks, f"block {block} outside the pool"
                holders[block].append((seq, index))
        for block, users in holders.items():
            if len(users) == 1:
                continue
            assert isinstance(self.cache, PrefixCache), f"block {block} handed to two sequences"
            (first, index), *_ = users
            tokens = first.token_ids[index * size:(index + 1) * size]
            for seq, other_index in users:
                assert other_index == index and (index + 1) * size <= seq.num_computed_tokens
                assert seq.token_ids[index * size:(index + 1) * size] == tokens
        ref_counts = getattr(self.cache.pool, "ref_counts", None)
        if ref_counts is not None:
            assert min(ref_counts) >= 0
            assert all(ref_counts[block] == len(holders.get(block, ())) for block in range(self.cache.num_blocks))
        stats = self.cache.stats()
        assert 0 <= stats.used_tokens <= stats.reserved_tokens <= stats.capacity_tokens
        assert stats.reserved_tokens == len(holders) * size
        assert stats.num_free_blocks + len(holders) == stats.num_blocks
        assert stats.prefix_hit_tokens <= stats.prefix_query_tokens

    def teardown(self) -> None:
        for seq in self.running:
            self.cache.free(seq)
        self.cache.pool.check_all_free()
        stats = self.cache.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.used_tokens == stats.reserved_tokens == 0


STATEFUL = settings(max_examples=40, stateful_step_count=40, deadline=None)


@STATEFUL
class PagedMachine(CacheMachine):
    def make_cache(self) -> KVCacheStrategy:
        return PagedCache(block_size=BLOCK, capacity_tokens=CAPACITY)


@STATEFUL
class PrefixMachine(CacheMachine):
    def make_cache(self) -> KVCacheStrategy:
        return PrefixCache(block_size=BLOCK, capacity_tokens=CAPACITY)


class ContiguousMachine(CacheMachine):
    reserve: ReservePolicy

    def make_cache(self) -> KVCacheStrategy:
        return ContiguousCache(capacity_tokens=CAPACITY, reserve=self.reserve, max_model_len=MAX_MODEL_LEN, block_size=BLOCK)

    @invariant()
    def regions_are_contiguous(self) -> None:
        for seq in self.running:
            assert seq.block_table == list(range(seq.block_table[0], seq.block_table[0] + len(seq.block_table)))


@STATEFUL
class ContiguousMaxLenMachine(ContiguousMachine):
    reserve = "max_model_len"


@STATEFUL
class ContiguousRequestMachine(ContiguousMachine):
    reserve = "request"


TestPagedProperties = PagedMachine.TestCase
TestPrefixProperties = PrefixMachine.TestCase
TestContiguousMaxLenProperties = ContiguousMaxLenMachine.TestCase
TestContiguousRequestProperties = ContiguousRequestMachine.TestCase


# -- prefix cache ------------------------------------------------------------------------------
def test_shared_500_token_prefix_hits_496_tokens_in_31_blocks() -> None:
    cache = PrefixCache(block_size=16, capacity_tokens=4096)
    shared = list(range(100, 600))
    first = make_seq(0, shared + [1, 2, 3])
    assert cache.num_cached_prefix_tokens(first) == 0
    assert cache.admit(first, first.num_tokens)
    compute(cache, first, first.num_tokens)

    second = make_seq(1, shared + [7, 8])
    assert cache.num_cached_prefix_tokens(second) == 496
    assert cache.admit(second, second.num_tokens)
    assert second.num_computed_tokens == second.num_cached_tokens == 496
    assert second.block_table[:31] == first.block_table[:31]
    assert set(second.block_table[31:]).isdisjoint(first.block_table)
    assert all(cache.pool.ref_counts[block] == 2 for block in first.block_table[:31])
    stats = cache.stats()
    assert (stats.prefix_hit_tokens, stats.prefix_query_tokens) == (496, 503 + 502)
    assert stats.used_tokens == 503  # the 31 shared blocks count once
    compute(cache, second, second.num_tokens - 496)
    assert cache.stats().used_tokens == 503 + 6


@pytest.mark.parametrize(("prompt_len", "expected_hit"), [(512, 496), (497, 496), (496, 480), (16, 0)])
def test_prefix_hit_leaves_at_least_one_token_to_compute(prompt_len: int, expected_hit: int) -> None:
    cache = PrefixCache(block_size=16, capacity_tokens=4096)
    tokens = list(range(100, 612))
    owner = make_seq(0, tokens)
    assert cache.admit(owner, owner.num_tokens)
    compute(cache, owner, owner.num_tokens)
    assert cache.num_cached_prefix_tokens(make_seq(1, tokens[:prompt_len])) == expected_hit


def published_block(cache: PrefixCache, seq_id: int, token: int) -> Sequence:
    """Admit a one-block prompt of ``token`` and compute it, so that block is published."""
    seq = make_seq(seq_id, [token] * 4)
    assert cache.admit(seq, 4)
    compute(cache, seq, 4)
    return seq


def is_cached(cache: PrefixCache, token: int) -> bool:
    return cache.num_cached_prefix_tokens(make_seq(99, [token] * 4 + [0])) == 4


def test_parked_blocks_are_evicted_least_recently_freed_first() -> None:
    cache = PrefixCache(block_size=4, capacity_tokens=16)  # 4 blocks
    x, y, z = (published_block(cache, seq_id, token) for seq_id, token in enumerate((1, 2, 3)))
    for seq in (y, x, z):  # parks y, then x, then z
        cache.free(seq)
    assert cache.stats().num_free_blocks == 4 and all(is_cached(cache, token) for token in (1, 2, 3))

    needs_two = make_seq(10, [7] * 8)
    assert cache.admit(needs_two, 8)  # the one never-used block + the least recently parked (y)
    assert (is_cached(cache, 1), is_cached(cache, 2), is_cached(cache, 3)) == (True, False, True)
    needs_one = make_seq(11, [8] * 4)
    assert cache.admit(needs_one, 4)  # evicts x next
    assert (is_cached(cache, 1), is_cached(cache, 3)) == (False, True)
    assert cache.stats().num_free_blocks == 1


def test_a_hit_revives_a_parked_block() -> None:
    cache = PrefixCache(block_size=4, capacity_tokens=16)  # 4 blocks
    first = make_seq(0, [1, 1, 1, 1, 2])
    assert cache.admit(first, 5)
    compute(cache, first, 5)
    shared_block = first.block_table[0]
    cache.free(first)
    assert cache.pool.ref_counts[shared_block] == 0 and shared_block in cache.pool.parked
    assert cache.stats().num_free_blocks == 4

    second = make_seq(1, [1, 1, 1, 1, 3])
    assert cache.admit(second, 5)
    assert second.block_table[0] == shared_block and second.num_computed_tokens == 4
    assert cache.pool.ref_counts[shared_block] == 1 and shared_block not in cache.pool.parked
    assert cache.stats().num_free_blocks == 2
    filler = make_seq(2, [9] * 8)
    assert cache.admit(filler, 8)  # takes the 2 free blocks; the revived block is not evictable
    assert not cache.admit(make_seq(3, [8]), 1)
    for seq in (second, filler):
        cache.free(seq)
    cache.pool.check_all_free()


def test_refused_admission_does_not_revive_hits() -> None:
    cache = PrefixCache(block_size=4, capacity_tokens=8)  # 2 blocks
    first = make_seq(0, [1, 1, 1, 1, 2])
    assert cache.admit(first, 5)
    compute(cache, first, 5)
    cache.free(first)
    longer = make_seq(1, [1, 1, 1, 1] + [3] * 8)  # 1 hit + 2 fresh blocks > the 1 block left
    assert cache.num_cached_prefix_tokens(longer) == 4
    assert not cache.admit(longer, longer.num_tokens)
    assert longer.block_table == [] and cache.pool.ref_counts == [0, 0] and len(cache.pool.parked) == 1
    assert cache.stats().prefix_query_tokens == 5


def test_concurrent_identical_prompts_publish_once_and_free_cleanly() -> None:
    cache = PrefixCache(block_size=4, capacity_tokens=64)
    twins = [make_seq(seq_id, [1] * 9) for seq_id in (0, 1)]
    for seq in twins:  # both admitted before either computed: no hit, two private copies
        assert cache.admit(seq, 9)
    for seq in twins:
        compute(cache, seq, 9)
    assert len(cache.pool.cached) == 2  # blocks 0 and 1 of the first twin
    for seq in twins:
        cache.free(seq)
    assert len(cache.pool.parked) == 2
    cache.pool.check_all_free()


# -- contiguous cache ---------------------------------------------------------------------------
def admit_until_full(cache: KVCacheStrategy, prompt_len: int, max_tokens: int) -> list[Sequence]:
    admitted: list[Sequence] = []
    while True:
        seq = make_seq(len(admitted), [5] * prompt_len, max_tokens)
        if not cache.admit(seq, seq.num_tokens):
            return admitted
        admitted.append(seq)


def test_contiguous_reserves_max_model_len_while_paged_packs_requests() -> None:
    prompt_len, max_tokens = 104, 8  # ~100-token requests, 112 tokens worst case
    contiguous = ContiguousCache(capacity_tokens=4096, reserve="max_model_len", max_model_len=1024)
    paged = PagedCache(block_size=16, capacity_tokens=4096)
    by_request = ContiguousCache(capacity_tokens=4096, reserve="request")
    counts = {}
    for name, cache in (("contiguous", contiguous), ("paged", paged), ("request", by_request)):
        running = admit_until_full(cache, prompt_len, max_tokens)
        for seq in running:
            compute(cache, seq, seq.num_tokens)
        counts[name] = len(running)
        stats = cache.stats()
        assert stats.used_tokens == len(running) * prompt_len
        if name == "contiguous":
            assert stats.reserved_tokens == 4096 and stats.used_tokens / stats.reserved_tokens < 0.15
        else:
            assert stats.used_tokens / stats.reserved_tokens > 0.9
    assert counts == {"contiguous": 4, "paged": 256 // 7, "request": 4096 // 112}


def test_contiguous_external_fragmentation_and_coalescing() -> None:
    cache = ContiguousCache(capacity_tokens=64, reserve="request", block_size=4)  # 16 blocks
    a, b, c, d = (make_seq(seq_id, [5] * 8, 8) for seq_id in range(4))  # 16 tokens = 4 blocks each
    for seq in (a, b, c, d):
        assert cache.admit(seq, seq.num_tokens)
    cache.free(a)
    cache.free(c)
    big = make_seq(9, [5] * 16, 8)  # 24 tokens = 6 blocks
    assert cache.pool.num_free == 8 and cache.pool.largest_free_extent == 4
    assert not cache.admit(big, big.num_tokens)  # enough free blocks in total, no hole long enough
    cache.free(b)  # a + b + c coalesce into one hole of 12 blocks
    assert cache.pool.free_extents == [(0, 12)]
    assert cache.admit(big, big.num_tokens) and big.block_table == list(range(6))


def test_contiguous_region_does_not_grow() -> None:
    cache = ContiguousCache(capacity_tokens=256, reserve="request", block_size=4)
    seq = make_seq(0, [5] * 6, 4)  # region of 10 tokens -> 3 blocks
    assert cache.admit(seq, 6)
    assert cache.grow(seq, 12) and not cache.grow(seq, 13)
    assert cache.max_tokens_per_seq() == 256


def test_contiguous_learns_max_model_len_from_the_engine() -> None:
    cache = ContiguousCache(capacity_tokens=4096)
    with pytest.raises(RuntimeError, match="bind_model_limits"):
        cache.max_tokens_per_seq()
    cache.bind_model_limits(2048)
    assert cache.max_tokens_per_seq() == 2048
    explicit = ContiguousCache(capacity_tokens=4096, max_model_len=512)
    explicit.bind_model_limits(2048)  # the configured value wins
    assert explicit.max_tokens_per_seq() == 512
    with pytest.raises(ValueError, match="capacity_tokens.*max_model_len"):
        ContiguousCache(capacity_tokens=4096).bind_model_limits(8192)
    with pytest.raises(ValueError, match="capacity_tokens.*max_model_len"):
        ContiguousCache(capacity_tokens=1000, max_model_len=1024)
    ContiguousCache(capacity_tokens=1000, reserve="request").bind_model_limits(8192)  # regions are per request


def test_arena_refuses_to_free_free_memory() -> None:
    arena = FirstFitArena(8)
    start = arena.allocate(3)
    arena.release(start, 3)
    with pytest.raises(RuntimeError, match="double free"):
        arena.release(start, 3)
    arena.check_all_free()


# -- all caches -------------------------------------------------------------------------------
ALL_CACHES = {
    "paged": lambda: PagedCache(block_size=BLOCK, capacity_tokens=CAPACITY),
    "prefix": lambda: PrefixCache(block_size=BLOCK, capacity_tokens=CAPACITY),
    "contiguous": lambda: ContiguousCache(capacity_tokens=CAPACITY, max_model_len=MAX_MODEL_LEN, block_size=BLOCK),
}


@pytest.mark.parametrize("name", ALL_CACHES)
def test_double_free_raises(name: str) -> None:
    cache = ALL_CACHES[name]()
    seq = make_seq(0, [5, 6, 5])
    assert cache.admit(seq, seq.num_tokens)
    cache.free(seq)
    with pytest.raises(RuntimeError, match="double free"):
        cache.free(seq)
    cache.pool.check_all_free()


@pytest.mark.parametrize("name", ["paged", "contiguous", "prefix"])
def test_cache_yaml_builds_the_strategy_with_the_shared_budget(name: str) -> None:
    cache = instantiate(OmegaConf.load(CONF_DIR / "cache" / f"{name}.yaml"))
    if isinstance(cache, ContiguousCache):
        cache.bind_model_limits(8192)
    assert isinstance(cache, KVCacheStrategy)
    assert cache.stats().capacity_tokens == 16384 and cache.block_size == 16
