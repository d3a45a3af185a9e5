"""Squeezed pools and prefix sharing, asserted from the engine's own counters."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from hf_reference import hf_greedy

SQUEEZE_PROMPTS = [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]
SQUEEZE_PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)  # 9 tokens = 3 blocks of 4 each


def squeezed(ckpt, scheduler: str, capacity_tokens: int) -> LLM:
    return LLM(model=str(ckpt), cache="paged", scheduler=scheduler, device="cpu", block_size=4,
               capacity_tokens=capacity_tokens, max_num_seqs=4)


@pytest.mark.parametrize("scheduler", ["static", "continuous", "preemptive"])
def test_squeezed_pool_completes_with_unsqueezed_tokens(tiny_llama_ckpt, scheduler):
    roomy = squeezed(tiny_llama_ckpt, scheduler, capacity_tokens=256).generate(SQUEEZE_PROMPTS, SQUEEZE_PARAMS)
    llm = squeezed(tiny_llama_ckpt, scheduler, capacity_tokens=12)  # 3 blocks for 4 requests
    outputs = llm.generate(SQUEEZE_PROMPTS, SQUEEZE_PARAMS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]
    assert outputs[0].token_ids == hf_greedy(str(tiny_llama_ckpt), tuple(SQUEEZE_PROMPTS[0]), 6)
    records = llm.step_records
    assert max(r.kv_reserved_tokens for r in records) <= 12
    assert any(r.num_waiting > 0 for r in records), "someone must have queued"
    preemptions = sum(r.num_preempted for r in records)
    if scheduler == "preemptive":
        # it admitted more than one at a time (one block each) and paid for it with preemptions
        assert max(r.num_running for r in records) > 1
        assert preemptions > 0
        assert sum(o.num_preemptions for o in outputs) == preemptions
    else:
        # worst-case reservation: one 3-block request at a time, never a preemption
        assert max(r.num_running for r in records) == 1
        assert preemptions == 0
    llm.free_blocks_check()


def test_request_that_can_never_fit_is_rejected(tiny_llama_ckpt):
    llm = squeezed(tiny_llama_ckpt, "preemptive", capacity_tokens=12)
    with pytest.raises(ValueError, match="capacity_tokens"):
        llm.add_request(list(range(3, 13)), SamplingParams(max_tokens=6))  # 16 tokens > 12 slots
    assert llm.generate(SQUEEZE_PROMPTS[:1], SQUEEZE_PARAMS)[0].finished


def test_shared_prefix_is_prefilled_once(long_context_ckpt):
    rng = random.Random(0)
    shared = [rng.randrange(3, 256) for _ in range(500)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(rng.randint(5, 12))] for _ in range(4)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(model=str(long_context_ckpt), cache="prefix", device="cpu", block_size=16, capacity_tokens=4096,
              max_num_batched_tokens=4096, chunked_prefill=False)  # the first prompt in one step

    first = llm.add_request(prompts[0], params)
    llm.step()  # the first user's prefill publishes the 31 full blocks of the shared prompt
    assert llm.step_records[0].num_prefill_tokens == len(prompts[0])
    later = [llm.add_request(prompt, params) for prompt in prompts[1:]]
    outputs = {}
    while llm.has_unfinished():
        outputs.update((o.request_id, o) for o in llm.step() if o.finished)

    hit_tokens = 31 * 16  # full blocks inside the 500 shared tokens
    for request_id, prompt in zip(later, prompts[1:]):
        assert outputs[request_id].num_cached_tokens == hit_tokens
    later_prefill = sum(r.num_prefill_tokens for r in llm.step_records[1:])
    assert later_prefill == sum(len(p) - hit_tokens for p in prompts[1:])
    assert sum(r.prefix_hit_tokens for r in llm.step_records) == 3 * hit_tokens

    no_sharing = LLM(model=str(long_context_ckpt), cache="paged", device="cpu", block_size=16, capacity_tokens=4096)
    expected = no_sharing.generate(prompts, params)
    for request_id, reference in zip([first, *later], expected):
        assert outputs[request_id].token_ids == reference.token_ids
    assert expected[1].token_ids == hf_greedy(str(long_context_ckpt), tuple(prompts[1]), 4)
    llm.free_blocks_check()
