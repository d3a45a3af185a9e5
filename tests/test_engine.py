"""The engine core against Hugging Face: paged cache, continuous batching, torch_sdpa."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from hf_reference import hf_greedy


def ragged_prompts(seed: int, count: int, vocab: int, min_len: int = 1, max_len: int = 13) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


@pytest.fixture(scope="module")
def paged_llm(tiny_llama_ckpt):
    return LLM(model=str(tiny_llama_ckpt), cache="paged", scheduler="continuous", attention="torch_sdpa",
               device="cpu", dtype="float32", block_size=4, capacity_tokens=128, max_num_seqs=8)


def test_ragged_batch_across_block_boundaries_equals_hf(paged_llm, tiny_llama_ckpt):
    prompts = ragged_prompts(0, 6, paged_llm.model_config.vocab_size)
    max_tokens = [1, 3, 5, 9, 6, 11]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = paged_llm.generate(prompts, params)
    for prompt, budget, output in zip(prompts, max_tokens, outputs):
        assert output.token_ids == hf_greedy(str(tiny_llama_ckpt), tuple(prompt), budget)
        assert output.finish_reason == "length"
    paged_llm.free_blocks_check()


def test_requests_added_mid_decode_equal_hf(paged_llm, tiny_llama_ckpt):
    prompts = ragged_prompts(1, 5, paged_llm.model_config.vocab_size)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = {paged_llm.add_request(prompts[0], params): 0, paged_llm.add_request(prompts[1], params): 1}
    outputs = {}
    late = iter(range(2, 5))
    steps = 0
    while paged_llm.has_unfinished():
        for output in paged_llm.step():
            if output.finished:
                outputs[output.request_id] = output
        steps += 1
        if steps in (2, 3, 6):  # join while the first ones decode
            index = next(late)
            ids[paged_llm.add_request(prompts[index], params)] = index
    assert len(outputs) == 5
    for request_id, index in ids.items():
        assert outputs[request_id].token_ids == hf_greedy(str(tiny_llama_ckpt), tuple(prompts[index]), 8)
    # the late joiners really shared steps with running sequences
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in paged_llm.step_records)
    paged_llm.free_blocks_check()


def test_qwen2_and_odd_shapes_equal_hf(tiny_qwen2_ckpt, odd_ckpt):
    for ckpt in (tiny_qwen2_ckpt, odd_ckpt):
        llm = LLM(model=str(ckpt), device="cpu", block_size=4, capacity_tokens=128)
        prompts = ragged_prompts(2, 3, llm.model_config.vocab_size)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=7, ignore_eos=True))
        for prompt, output in zip(prompts, outputs):
            assert output.token_ids == hf_greedy(str(ckpt), tuple(prompt), 7)
        llm.free_blocks_check()


def test_free_twice_raises(paged_llm):
    from engine.sequence import Sequence

    seq = Sequence(seq_id=10_000, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(), arrival_time=0.0)
    assert paged_llm.cache.admit(seq, 5)
    paged_llm.cache.free(seq)
    with pytest.raises(RuntimeError, match="double free"):
        paged_llm.cache.free(seq)
    paged_llm.free_blocks_check()


@pytest.mark.parametrize(
    "prompt, params, limit",
    [
        ([], SamplingParams(max_tokens=4), "empty"),
        ([1] * 300, SamplingParams(max_tokens=4), "max_model_len"),
        ([1, 2, 10**6], SamplingParams(max_tokens=4), "vocabulary"),
        ([1] * 100, SamplingParams(max_tokens=100), "capacity_tokens"),
    ],
)
def test_bad_request_is_rejected_and_others_finish(paged_llm, tiny_llama_ckpt, prompt, params, limit):
    good = [5, 6, 7, 8, 9]
    good_id = paged_llm.add_request(good, SamplingParams(max_tokens=6, ignore_eos=True))
    paged_llm.step()  # the good request is mid-flight when the bad one arrives
    with pytest.raises(ValueError, match=limit):
        paged_llm.add_request(prompt, params)
    outputs = []
    while paged_llm.has_unfinished():
        outputs += [o for o in paged_llm.step() if o.finished]
    assert [o.request_id for o in outputs] == [good_id]
    assert outputs[0].token_ids == hf_greedy(str(tiny_llama_ckpt), tuple(good), 6)
    paged_llm.free_blocks_check()


def test_max_tokens_below_one_is_rejected():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("group, kwargs", [("cache", {"cache": "nope"}), ("scheduler", {"scheduler": "nope"}),
                                            ("attention", {"attention": "nope"}), ("model", {"model": "nope"})])
def test_unknown_strategy_names_are_rejected(group, kwargs):
    with pytest.raises(ValueError, match=f"unknown {group} 'nope'"):
        LLM(device="cpu", **kwargs)


def test_prompt_longer_than_token_budget_without_chunking_is_rejected(tiny_llama_ckpt):
    llm = LLM(model=str(tiny_llama_ckpt), device="cpu", block_size=4, capacity_tokens=128, max_num_batched_tokens=8,
              chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens=8"):
        llm.add_request(list(range(1, 12)), SamplingParams(max_tokens=2))
