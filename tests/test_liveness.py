"""Liveness: a request the configured scheduler could never run is rejected at ``add_request``
(naming the limit); a step that can schedule nothing while work is pending raises
``SchedulerStalled`` instead of returning ``[]`` forever; ``generate()`` validates everything
first and keeps the outputs of requests it did not add. Every engine loop here is bounded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.interfaces.scheduler import SchedulerStalled
from engines import build_engine
from hf_reference import hf_greedy

ROOT = Path(__file__).resolve().parents[1]
# A workload the preemptive scheduler could never finish: 4-block pool, token budget 8, two requests
# of 4 prompt tokens and 12 new ones; a preempted request recomputes up to 4 + 12 - 1 = 15 tokens in
# one step, over the budget.
HANG = dict(cache="paged", scheduler="preemptive", block_size=4, capacity_tokens=16, max_num_batched_tokens=8,
            max_num_seqs=4)
HANG_PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12]]
HANG_PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def engine(ckpt: Path, **options) -> LLM:
    return LLM(model=str(ckpt), device="cpu", **options)


def drain(llm: LLM, max_steps: int = 300) -> dict[int, object]:
    """Step until idle (bounded); every step while work is pending must compute something."""
    finished = {}
    for _ in range(max_steps):
        if not llm.has_unfinished():
            return finished
        steps_before = len(llm.step_records)
        outputs = llm.step()
        assert len(llm.step_records) == steps_before + 1 or outputs, "an empty step while work is pending"
        finished.update({o.request_id: o for o in outputs if o.finished})
    raise AssertionError(f"engine did not drain in {max_steps} steps")


def test_unrecomputable_request_is_rejected_at_add_naming_the_budget(tiny_llama_ckpt):
    """A request whose recompute after preemption can never fit the token budget is refused at
    ``add_request`` (the message names the budget and chunked prefill), and nothing is queued."""
    llm = engine(tiny_llama_ckpt, **HANG)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=8.*chunked_prefill"):
        llm.add_request(HANG_PROMPTS[0], HANG_PARAMS)
    assert not llm.has_unfinished()


@pytest.mark.parametrize("fix", [{"chunked_prefill": True}, {"max_num_batched_tokens": 4 + 12 - 1}])
def test_stalling_workload_completes_once_the_limit_allows(tiny_llama_ckpt, fix):
    """Chunked prefill, or a budget of exactly prompt + max_tokens - 1, runs that workload through
    preemption to HF's greedy tokens, with every block freed."""
    llm = engine(tiny_llama_ckpt, **{**HANG, **fix})
    ids = [llm.add_request(prompt, HANG_PARAMS) for prompt in HANG_PROMPTS]
    finished = drain(llm)
    assert sum(o.num_preemptions for o in finished.values()) > 0, "the pool should force a preemption"
    for request_id, prompt in zip(ids, HANG_PROMPTS):
        assert finished[request_id].token_ids == hf_greedy(str(tiny_llama_ckpt), tuple(prompt), 12)
    llm.free_blocks_check()


@pytest.mark.parametrize("scheduler, chunked, prompt_len, max_tokens, accepted", [
    # without chunked prefill the prompt is one step for every scheduler
    ("static", False, 9, 4, False), ("continuous", False, 9, 4, False), ("preemptive", False, 9, 4, False),
    # worst-case reservation: never preempted, so a long output is fine
    ("static", False, 8, 30, True), ("continuous", False, 8, 30, True),
    # recompute after preemption: prompt + max_tokens - 1 must fit the budget
    ("preemptive", False, 4, 5, True), ("preemptive", False, 4, 6, False),
    # chunked prefill splits prompts and recomputes across steps: no budget limit
    ("static", True, 20, 30, True), ("continuous", True, 20, 30, True), ("preemptive", True, 20, 30, True),
])
def test_token_budget_limit_per_scheduler(tiny_llama_ckpt, scheduler, chunked, prompt_len, max_tokens, accepted):
    llm = engine(tiny_llama_ckpt, cache="paged", scheduler=scheduler, block_size=4, capacity_tokens=64,
                 max_num_batched_tokens=8, chunked_prefill=chunked, max_num_seqs=2)
    prompt, params = list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if not accepted:
        with pytest.raises(ValueError, match="max_num_batched_tokens=8"):
            llm.add_request(prompt, params)
        return
    ids = [llm.add_request(prompt, params), llm.add_request(prompt[::-1], params)]
    finished = drain(llm)
    assert sorted(finished) == ids and all(len(o.token_ids) == max_tokens for o in finished.values())
    llm.free_blocks_check()


@pytest.mark.parametrize("cache", ["contiguous", "paged", "prefix"])
@pytest.mark.parametrize("scheduler", ["static", "continuous", "preemptive"])
def test_worst_case_over_the_pool_is_rejected_for_every_cache(tiny_llama_ckpt, cache, scheduler):
    # contiguous regions sized per request (reserve=request), so the pool is the limit there too
    reserve = {"reserve": "request"} if cache == "contiguous" else {}
    llm = build_engine(tiny_llama_ckpt, cache, scheduler, cache_options={"block_size": 4, "capacity_tokens": 32, **reserve})
    with pytest.raises(ValueError, match="capacity_tokens"):
        llm.add_request([5] * 20, SamplingParams(max_tokens=13))
    rid = llm.add_request([5] * 20, SamplingParams(max_tokens=12, ignore_eos=True))  # exactly the pool
    assert len(drain(llm)[rid].token_ids) == 12
    llm.free_blocks_check()


def test_stall_on_the_token_budget_raises_naming_request_and_limit(tiny_llama_ckpt):
    llm = engine(tiny_llama_ckpt, cache="paged", scheduler="continuous", block_size=4, capacity_tokens=64,
                 max_num_batched_tokens=16, chunked_prefill=False)  # unchunked: a prompt over the budget stalls
    rid = llm.add_request(list(range(3, 13)), SamplingParams(max_tokens=4))
    llm.scheduler.max_num_batched_tokens = 6  # a limit changed behind add_request's back
    with pytest.raises(SchedulerStalled, match=rf"request {rid} .*10 tokens.*max_num_batched_tokens=6"):
        llm.step()


@pytest.mark.parametrize("scheduler", ["static", "continuous", "preemptive"])
def test_stall_on_memory_raises_naming_request_and_free_blocks(tiny_llama_ckpt, scheduler):
    llm = engine(tiny_llama_ckpt, cache="paged", scheduler=scheduler, block_size=4, capacity_tokens=32)
    rid = llm.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    leaked = llm.cache.pool.allocate(7)  # memory that nobody running will ever free
    with pytest.raises(SchedulerStalled, match=rf"request {rid} .*KV memory.*1 of 8 blocks"):
        llm.step()
    for block in leaked:
        llm.cache.pool.release(block)
    assert len(drain(llm)[rid].token_ids) == 4  # once the memory is back, it runs


def test_invariants_raise_under_python_O():
    """Invariant checks are exceptions, not asserts: ``python -O`` keeps them."""
    code = (
        "from engine.interfaces.scheduler import ScheduledSequence, SchedulerInvariantError, SchedulerOutput\n"
        "from engine.sequence import Sequence, SequenceStatus\n"
        "from engine.sampling_params import SamplingParams\n"
        "from strategies.cache.paged import PagedCache\n"
        "from strategies.scheduler.continuous import ContinuousScheduler\n"
        "assert False, 'asserts must be off under -O'\n"
        "scheduler = ContinuousScheduler(PagedCache(block_size=4, capacity_tokens=16), max_model_len=64)\n"
        "seq = Sequence(0, [1, 2, 3], SamplingParams(), 0.0, status=SequenceStatus.RUNNING)\n"
        "try:\n"
        "    scheduler.check_invariants(SchedulerOutput(scheduled=[ScheduledSequence(seq, 3)]))\n"
        "except SchedulerInvariantError as error:\n"
        "    print('raised:', error)\n"
    )
    proc = subprocess.run([sys.executable, "-O", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "raised: sequence 0 has KV room for 0 tokens, needs 3" in proc.stdout


@pytest.mark.parametrize("bad_prompt, bad_params, limit", [
    ([], SamplingParams(max_tokens=2), "empty"),
    ([3, 10**6], SamplingParams(max_tokens=2), "vocabulary"),
    ([3] * 250, SamplingParams(max_tokens=10), "max_model_len"),
    ([3] * 30, SamplingParams(max_tokens=10), "capacity_tokens"),
    ([3] * 6, SamplingParams(max_tokens=8), "max_num_batched_tokens"),  # recompute of 6 + 7 > 12
])
def test_generate_validates_every_prompt_before_queueing_any(tiny_llama_ckpt, bad_prompt, bad_params, limit):
    llm = engine(tiny_llama_ckpt, cache="prefix", scheduler="preemptive", block_size=4, capacity_tokens=32,
                 max_num_batched_tokens=12)
    good = ([5, 6, 7], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match=limit):
        llm.generate([good[0], bad_prompt, good[0]], [good[1], bad_params, good[1]])
    assert not llm.has_unfinished() and not llm.requests, "nothing may be queued by a rejected call"


def test_generate_keeps_outputs_of_requests_it_did_not_add(tiny_llama_ckpt):
    llm = engine(tiny_llama_ckpt, cache="paged", scheduler="continuous", block_size=4, capacity_tokens=128)
    early = [20, 21, 22, 23]
    early_id = llm.add_request(early, SamplingParams(max_tokens=3, ignore_eos=True))  # finishes inside generate()
    mine = [5, 6, 7]
    [output] = llm.generate([mine], SamplingParams(max_tokens=8, ignore_eos=True))
    assert output.token_ids == hf_greedy(str(tiny_llama_ckpt), tuple(mine), 8)
    assert llm.has_unfinished(), "the early request's result is still to be collected"
    kept = llm.step()
    assert [(o.request_id, o.finished) for o in kept] == [(early_id, True)]
    assert kept[0].token_ids == hf_greedy(str(tiny_llama_ckpt), tuple(early), 3)
    assert not llm.has_unfinished() and llm.step() == []
    llm.free_blocks_check()
