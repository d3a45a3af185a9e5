"""Every YAML in conf/cache, conf/scheduler and conf/attention builds a working strategy.

The check is behavioural: each option, with the other two groups at a plain choice, serves a
short ragged workload (a late arrival, prompts crossing blocks) on the tiny model and yields HF's
greedy tokens, leaving every block free. A YAML added to a group is picked up here without
editing this file (docs/adding_a_strategy.md); the parity matrix (test_strategy_matrix.py)
then crosses it with the other groups.
"""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import available
from engine.interfaces.attention import AttentionBackend
from engine.interfaces.cache import KVCacheStrategy
from engine.interfaces.scheduler import Scheduler
from hf_reference import hf_greedy

PLAIN = {"cache": "paged", "scheduler": "continuous", "attention": "torch_sdpa"}
INTERFACES = {"cache": KVCacheStrategy, "scheduler": Scheduler, "attention": AttentionBackend}
PROMPTS = [([17, 40, 99, 5, 61, 7], 5, 0), ([8, 9], 7, 0), (list(range(30, 43)), 4, 1)]  # (prompt, max_tokens, step)
OPTIONS = [(group, name) for group in INTERFACES for name in available(group)]


@pytest.mark.parametrize("group, name", OPTIONS, ids=[f"{g}={n}" for g, n in OPTIONS])
def test_every_yaml_serves_hf_greedy_tokens(tiny_llama_ckpt, triton_available, group, name):
    if name == "triton_paged" and not triton_available:
        pytest.skip("triton is not installed")
    choice = {**PLAIN, group: name}
    capacity = 1024 if choice["cache"] == "contiguous" else 128  # contiguous reserves max_model_len (256) each
    llm = LLM(model=str(tiny_llama_ckpt), device="cpu", block_size=4, capacity_tokens=capacity, max_num_seqs=4, **choice)
    assert isinstance(getattr(llm, group), INTERFACES[group])
    ids, outputs, step = {}, {}, 0
    while len(outputs) < len(PROMPTS):
        for index, (prompt, max_tokens, arrival) in enumerate(PROMPTS):
            if arrival == step:
                ids[llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))] = index
        outputs.update((ids[o.request_id], o.token_ids) for o in llm.step() if o.finished)
        step += 1
        assert step < 100, "workload did not finish"
    for index, (prompt, max_tokens, _) in enumerate(PROMPTS):
        assert outputs[index] == hf_greedy(str(tiny_llama_ckpt), tuple(prompt), max_tokens)
    llm.free_blocks_check()
