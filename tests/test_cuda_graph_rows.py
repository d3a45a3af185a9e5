"""CUDA graph replay picks the same rows as the eager path, and the captured buckets are bounded.

A replayed decode graph computes logits for *every* row of a step whose rows are one token
each. Such a step may hold a one-token chunk from the middle of a prompt (chunked prefill under
a small token budget), which is not sampled, and the scheduler's policy decides where it sits.
These tests run on the CPU: a stand-in for the captured forward returns logits for every row,
as a replay does, and the runner must select the sampled rows from them exactly as it does
on the eager path (:func:`engine.runner.sampled_rows`).
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention_metadata import AttentionMetadata
from engine.cuda_graphs import batch_buckets, context_buckets
from engine.interfaces.scheduler import ScheduledSequence
from engine.runner import ModelRunner
from engine.sequence import Sequence


class CapturedForwardStandIn:
    """Stands in for :class:`engine.cuda_graphs.DecodeGraphs` on the CPU: for any step of
    one-token rows it runs the whole forward and returns logits ``[T, vocab]`` for every row,
    in step order, like a replayed graph."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.replayed_rows: list[int] = []

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return metadata.is_decode_only

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        self.replayed_rows.append(int(input_ids.shape[0]))
        runner = self.runner
        hidden = runner.model(input_ids, positions, runner.cache.kv_caches, metadata, runner.attention)
        return runner.model.compute_logits(hidden)


def build(ckpt, **kwargs) -> LLM:
    options = dict(device="cpu", dtype="float32", block_size=4, capacity_tokens=512, max_num_seqs=8,
                   prepack=False, fused_ops=False, quantized_weights=False, attention="torch_sdpa")
    options.update(kwargs)
    return LLM(model=str(ckpt), **options)


def running(llm: LLM, seq_id: int, prompt: list[int], computed: int) -> Sequence:
    """A sequence holding KV blocks for its prompt, ``computed`` of its tokens already computed."""
    seq = Sequence(seq_id=seq_id, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=4),
                   arrival_time=0.0)
    assert llm.cache.admit(seq, len(prompt) + 4)
    seq.num_computed_tokens = computed
    return seq


@pytest.mark.parametrize("chunk_at", [0, 1, 2])
def test_graph_path_returns_the_sampled_rows_of_a_step_with_a_one_token_prompt_chunk(tiny_llama_ckpt, chunk_at):
    """A step of three one-token rows, one of them token 5 of a 10-token prompt (not sampled) at
    any position: the graph path returns 2 rows, equal to the eager path's, in sampled order."""
    llm = build(tiny_llama_ckpt)
    chunk = running(llm, 0, list(range(10, 20)), computed=5)
    decodes = [running(llm, 1, [30, 31, 32, 33, 34, 35], computed=5), running(llm, 2, [40, 41, 42], computed=2)]
    order = decodes[:chunk_at] + [chunk] + decodes[chunk_at:]
    step = [ScheduledSequence(seq, 1) for seq in order]
    inputs = llm.runner.prepare(step)
    assert inputs.metadata.is_decode_only and [item.seq for item in inputs.sampled] == decodes

    eager = llm.runner.execute(inputs)
    llm.runner.graphs = CapturedForwardStandIn(llm.runner)
    graph = llm.runner.execute(inputs)
    assert llm.runner.graphs.replayed_rows == [3]
    assert graph.shape == eager.shape == (2, llm.model_config.vocab_size)
    torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_priority_chunked_prefill_serves_the_same_tokens_with_the_graph_stand_in(tiny_llama_ckpt, temperature):
    """Under priority order with chunked prefill and a 4-token budget, steps hold three decode rows
    and a one-token chunk of a lower-priority prompt; with the stand-in replaying them, greedy and
    sampled tokens equal the eager engine's (a shape mismatch would fail the step)."""
    prompts = [[5, 6], [7, 8], [9, 10], list(range(20, 31))]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=temperature, priority=p) for p in (0, 1, 2, 3)]
    options = dict(chunked_prefill=True, max_num_batched_tokens=4, scheduler_options={"policy": "priority"})

    def serve(llm: LLM) -> list[list[int]]:
        outputs = llm.generate(prompts, params)
        llm.free_blocks_check()
        assert all(output.finish_reason == "length" for output in outputs)
        return [output.token_ids for output in outputs]

    eager = build(tiny_llama_ckpt, **options)
    graphs = build(tiny_llama_ckpt, **options)
    stand_in = graphs.runner.graphs = CapturedForwardStandIn(graphs.runner)
    steps: list[tuple[int, int]] = []
    prepare = graphs.runner.prepare

    def recording_prepare(scheduled):
        inputs = prepare(scheduled)
        if inputs.metadata.is_decode_only:
            steps.append((inputs.metadata.num_seqs, len(inputs.sampled)))
        return inputs

    graphs.runner.prepare = recording_prepare
    assert serve(graphs) == serve(eager)
    assert any(rows > sampled for rows, sampled in steps)  # a replay held an unsampled chunk row
    assert len(stand_in.replayed_rows) == len(steps)


def test_batch_buckets_stop_at_max_num_seqs():
    """Padded batch sizes are the powers of two below max_num_seqs, then max_num_seqs."""
    assert batch_buckets(1) == [1]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert len(batch_buckets(256)) == 9
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_buckets(0)


def test_context_buckets_stop_at_4096_tokens_not_max_model_len():
    """Qwen2.5's 32,768-token limit gives 5 context buckets (256 ... 4096), whole blocks each;
    short limits get one bucket cut to the limit."""
    assert context_buckets(32768, 16) == [256, 512, 1024, 2048, 4096]
    assert context_buckets(100, 16) == [112]
    assert context_buckets(1000, 16) == [256, 512, 1008]
    assert context_buckets(300, 100) == [300]
    assert all(bucket % 16 == 0 for bucket in context_buckets(5000, 16))
    assert len(batch_buckets(256)) * len(context_buckets(32768, 16)) == 45  # graphs captured at most
