"""The step's metadata goes to the device as one copy per dtype through reusable host buffers
(:mod:`engine.step_staging`). Checked on the CPU with pinning off: the staged tensors equal
``tensor.to(dtype)`` with their shapes, the tensors of one dtype share one device tensor (one
copy), no step's tensors alias the host buffers or an earlier step's, the buffer grows when a step
needs more, the previous copy is waited on before a refill, and the runner's staged step equals
its plain one."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from engine import SamplingParams
from engine.interfaces.scheduler import ScheduledSequence
from engine.runner import ModelRunner
from engine.sequence import Sequence
from engine.step_staging import HostStaging


def step_tensors(rows: int) -> list[tuple[torch.Tensor, torch.dtype]]:
    ids = torch.arange(rows, dtype=torch.int64) + 100
    tables = torch.arange(6, dtype=torch.int64).view(2, 3) + 7
    return [(ids, torch.int64), (ids * 3, torch.int64), (torch.tensor([0, rows]), torch.int32),
            (tables, torch.int32), (torch.empty(0, dtype=torch.int64), torch.int64)]


def staging() -> HostStaging:
    return HostStaging(torch.device("cpu"), pin_memory=False)


def test_staged_tensors_equal_their_plain_copies_and_share_one_copy_per_dtype():
    tensors = step_tensors(5)
    staged = staging().stage(tensors)
    for (host, dtype), out in zip(tensors, staged):
        assert out.dtype == dtype and out.shape == host.shape
        assert torch.equal(out, host.to(dtype))
    storages = {dtype: {out.untyped_storage().data_ptr() for (_, d), out in zip(tensors, staged) if d == dtype}
                for dtype in (torch.int64, torch.int32)}
    assert all(len(pointers) == 1 for pointers in storages.values())  # one device tensor, one copy, per dtype
    assert storages[torch.int64] != storages[torch.int32]


def test_no_step_aliases_the_host_buffers_or_an_earlier_step():
    """A later, larger step grows the buffer and leaves the earlier step's device tensors as they were."""
    stage = staging()
    first = stage.stage(step_tensors(5))
    first_values = [t.clone() for t in first]
    buffer = stage.buffers[torch.int64]
    second = stage.stage(step_tensors(3000))  # 6,000 int64 values: past the first buffer's 1,024
    assert stage.buffers[torch.int64].numel() >= 6000 and stage.buffers[torch.int64] is not buffer
    for values, tensor in zip(first_values, first):
        assert torch.equal(values, tensor)
    assert torch.equal(second[0], torch.arange(3000) + 100)
    pointers = {t.untyped_storage().data_ptr() for t in first + second}
    assert not pointers & {b.untyped_storage().data_ptr() for b in stage.buffers.values()}


def test_the_previous_copy_is_waited_on_before_the_buffers_are_refilled():
    stage = staging()
    events: list[str] = []
    stage._copied = SimpleNamespace(synchronize=lambda: events.append("waited"))
    stage.buffers[torch.int64] = torch.full((1024,), -1, dtype=torch.int64)
    stage.stage([(torch.arange(4), torch.int64)])
    assert events == ["waited"]


def test_the_runner_stages_on_cuda_only_and_a_staged_step_equals_the_plain_one():
    """A mixed step (a decode, a 3-token prefill chunk mid-prompt, a whole prompt) gives the same
    tensors through the staging object as through plain copies."""
    assert ModelRunner(None, None, None, torch.device("cuda", 0)).staging.pin_memory is True
    cache = SimpleNamespace(block_size=4)
    plain = ModelRunner(None, cache, None, torch.device("cpu"))
    assert plain.staging is None

    def seq(seq_id: int, prompt: list[int], computed: int, blocks: list[int]) -> Sequence:
        s = Sequence(seq_id=seq_id, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=4),
                     arrival_time=0.0)
        s.num_computed_tokens, s.block_table = computed, blocks
        return s

    step = [ScheduledSequence(seq(0, list(range(10, 16)), 5, [3, 9]), 1),
            ScheduledSequence(seq(1, list(range(20, 30)), 2, [4, 5, 6]), 3),
            ScheduledSequence(seq(2, [40, 41, 42], 0, [7]), 3)]
    expected = plain.prepare(step)
    staged_runner = ModelRunner(None, cache, None, torch.device("cpu"))
    staged_runner.staging = staging()
    staged = staged_runner.prepare(step)
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(staged, name), getattr(expected, name)), name
    for name in ("query_start_loc", "query_lens", "context_lens", "slot_mapping", "block_tables"):
        a, b = getattr(staged.metadata, name), getattr(expected.metadata, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert [item.seq.seq_id for item in staged.sampled] == [0, 2]
