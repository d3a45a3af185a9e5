"""Abort and failure isolation: a request can leave at any point, a failing forward pass fails
only its own step's requests, and in both cases every KV block comes back."""
from __future__ import annotations

import itertools

import pytest

from engine import LLM, SamplingParams
from engine.sequence import SequenceStatus
from hf_reference import hf_greedy

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
CACHES = ["contiguous", "paged", "prefix"]
SCHEDULERS = ["static", "continuous", "preemptive"]


def small_engine(ckpt, cache: str, scheduler: str, capacity_tokens: int = 64) -> LLM:
    return LLM(model=str(ckpt), cache=cache, scheduler=scheduler, device="cpu", block_size=4,
               capacity_tokens=capacity_tokens, max_num_seqs=2)


def run_to_end(llm: LLM, limit: int = 500) -> dict[int, object]:
    finished = {}
    for _ in range(limit):
        if not llm.has_unfinished():
            return finished
        finished.update({o.request_id: o for o in llm.step() if o.finished})
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize("cache,scheduler", list(itertools.product(CACHES, SCHEDULERS)))
def test_abort_waiting_running_and_preempted(tiny_llama_ckpt, cache, scheduler):
    # capacity 24 with max 2 running: requests 2 and 3 wait; the preemptive scheduler also preempts
    llm = small_engine(tiny_llama_ckpt, cache, scheduler, capacity_tokens=24 if cache != "contiguous" else 256)
    ids = [llm.add_request(p, PARAMS) for p in PROMPTS]
    llm.step()
    llm.step()
    states = {rid: llm.requests[rid].status for rid in ids}
    running = [rid for rid in ids if states[rid] is SequenceStatus.RUNNING]
    waiting = [rid for rid in ids if states[rid] in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)]
    assert running and waiting, states
    victims = [running[0], waiting[-1]]
    assert all(llm.abort_request(rid) for rid in victims)
    assert not llm.abort_request(victims[0]), "a second abort of the same request is refused"
    aborted = [o for o in llm.step() if o.finish_reason == "abort"]
    assert sorted(o.request_id for o in aborted) == sorted(victims)
    assert all(o.finished for o in aborted)
    rest = run_to_end(llm)
    survivors = [rid for rid in ids if rid not in victims]
    assert sorted(rest) == sorted(survivors)
    for rid in survivors:
        assert rest[rid].token_ids == hf_greedy(str(tiny_llama_ckpt), tuple(PROMPTS[rid]), PARAMS.max_tokens)
    assert not llm.abort_request(survivors[0]), "finished requests cannot be aborted"
    llm.free_blocks_check()


def test_abort_of_the_only_request_returns_its_blocks(tiny_llama_ckpt):
    llm = small_engine(tiny_llama_ckpt, "paged", "continuous")
    rid = llm.add_request(PROMPTS[0], PARAMS)
    llm.step()
    assert llm.cache.stats().reserved_tokens > 0
    llm.abort_request(rid)
    assert llm.has_unfinished(), "the abort is reported by the next step"
    (output,) = llm.step()
    assert output.finish_reason == "abort" and output.request_id == rid and len(output.token_ids) == 1
    assert not llm.has_unfinished()
    llm.free_blocks_check()
    assert not llm.abort_request(12345)


class FailingForward:
    """Wraps the runner's ``execute`` and raises at chosen calls."""

    def __init__(self, execute, failing_calls: set[int]) -> None:
        self.execute, self.failing_calls, self.calls = execute, failing_calls, 0

    def __call__(self, inputs):
        self.calls += 1
        if self.calls in self.failing_calls:
            raise RuntimeError("injected fault in the forward pass")
        return self.execute(inputs)


@pytest.mark.parametrize("cache,scheduler", [("paged", "continuous"), ("prefix", "preemptive"), ("contiguous", "static")])
def test_failing_forward_fails_only_its_step(tiny_llama_ckpt, cache, scheduler):
    llm = small_engine(tiny_llama_ckpt, cache, scheduler, capacity_tokens=512)  # contiguous: 2 x max_model_len
    first = [llm.add_request(p, PARAMS) for p in PROMPTS[:2]]
    llm.step()  # both admitted and prefilled
    llm.runner.execute = FailingForward(llm.runner.execute, failing_calls={1})
    late = [llm.add_request(p, PARAMS) for p in PROMPTS[2:]]  # queued: max_num_seqs=2
    with pytest.warns(UserWarning, match="injected fault"):
        failed = llm.step()
    assert sorted(o.request_id for o in failed) == sorted(first)
    assert all(o.finished and o.finish_reason == "error" and "injected fault" in o.error for o in failed)
    rest = run_to_end(llm)
    assert sorted(rest) == sorted(late)
    for rid in late:
        assert rest[rid].finish_reason == "length"
        assert rest[rid].token_ids == hf_greedy(str(tiny_llama_ckpt), tuple(PROMPTS[rid]), PARAMS.max_tokens)
    llm.free_blocks_check()
    again = llm.generate(PROMPTS[:2], PARAMS)
    assert [o.token_ids for o in again] == [hf_greedy(str(tiny_llama_ckpt), tuple(p), 10) for p in PROMPTS[:2]]


def test_step_reports_unfinished_requests_that_got_a_token(tiny_llama_ckpt):
    llm = small_engine(tiny_llama_ckpt, "paged", "continuous")
    rid = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    seen = []
    while llm.has_unfinished():
        seen.extend((o.request_id, len(o.token_ids), o.finished) for o in llm.step())
    assert seen == [(rid, 1, False), (rid, 2, False), (rid, 3, True)]
