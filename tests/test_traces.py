"""workload=trace: arrivals on the trace's clock scaled by time_scale, shared hash ids shared as
prompt blocks (and hit in the prefix cache), damaged lines named by file, line and field."""
from __future__ import annotations

from pathlib import Path

import pytest

from experiments.harness.traces import SAMPLE_TRACE, load_trace, trace
from tests.harness_runs import SIMULATED_TINY, run_once

VOCAB, SPECIAL = 512, (0, 1, 2)


def test_arrivals_and_lengths_follow_the_trace(tmp_path: Path) -> None:
    file = tmp_path / "t.jsonl"
    file.write_text('{"timestamp": 1000, "input_length": 20, "output_length": 5}\n'
                    '{"timestamp": 3000, "input_length": 7, "output_length": 9}\n'
                    '{"timestamp": 1500, "input_length": 12, "output_length": 3}\n')
    requests = trace(VOCAB, SPECIAL, path=str(file), time_scale=0.5)
    assert [r.arrival_offset_s for r in requests] == [0.0, 0.25, 1.0]
    assert [len(r.prompt_token_ids) for r in requests] == [20, 12, 7]
    assert [r.sampling_params.max_tokens for r in requests] == [5, 3, 9]
    assert trace(VOCAB, SPECIAL, path=str(file), max_requests=2)[-1].arrival_offset_s == 0.5


def test_shared_hash_ids_share_prompt_blocks(tmp_path: Path) -> None:
    file = tmp_path / "t.jsonl"
    file.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [5, 6, 8]}\n'
                    '{"timestamp": 1, "input_length": 12, "output_length": 2, "hash_ids": [5, 6, 9]}\n'
                    '{"timestamp": 2, "input_length": 12, "output_length": 2, "hash_ids": [7, 6]}\n')
    a, b, c = trace(VOCAB, SPECIAL, path=str(file), hash_block_size=4)
    assert a.prompt_token_ids[:8] == b.prompt_token_ids[:8]          # blocks 5 and 6
    assert a.prompt_token_ids[8:10] != b.prompt_token_ids[8:10]       # 8 vs 9
    assert c.prompt_token_ids[4:8] == a.prompt_token_ids[4:8]          # block 6 in second place
    assert len(c.prompt_token_ids) == 12 and c.prompt_token_ids[:4] != a.prompt_token_ids[:4]
    assert not {t for r in (a, b, c) for t in r.prompt_token_ids} & set(SPECIAL)


@pytest.mark.parametrize("text, message", [
    ("", r"t\.jsonl: the file is empty"),
    ('{"timestamp": 0, "input_length": 4, "output_length": 2}\n{"timestamp": 5, "output_length": 2}\n',
     r"t\.jsonl:2: field 'input_length' is missing"),
    ('{"timestamp": -1, "input_length": 4, "output_length": 2}\n', r"t\.jsonl:1: field 'timestamp' must be >= 0"),
    ('{"timestamp": 0, "input_length": 4, "output_length": 0}\n', r"t\.jsonl:1: field 'output_length' must be >= 1"),
    ('{"timestamp": 0, "input_length": 4.5, "output_length": 2}\n', r"t\.jsonl:1: field 'input_length' must be an integer"),
    ('{"timestamp": 0, "input_length": 4, "output_length": 2, "hash_ids": [1, "x"]}\n',
     r"t\.jsonl:1: field 'hash_ids\[1\]' must be a non-negative integer"),
    ('{"timestamp": 0, "input_length": 4, "output_length": 2}\n{"timestamp": 1,\n', r"t\.jsonl:2: not valid JSON"),
])
def test_damaged_traces_name_file_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    file = tmp_path / "t.jsonl"
    file.write_text(text)
    with pytest.raises(ValueError, match=message):
        trace(VOCAB, SPECIAL, path=str(file))


def test_the_bundled_trace_replays_with_prefix_hits_on_the_simulator(tmp_path: Path) -> None:
    entries = load_trace(SAMPLE_TRACE)
    assert len(entries) >= 30 and any(e.hash_ids for e in entries)
    outcome = run_once([*SIMULATED_TINY, "workload=trace", "cache=prefix", "workload.time_scale=0.1"], tmp_path)
    assert outcome.summary["status"] == "ok", outcome.summary.get("error")
    metrics = outcome.summary["metrics"]
    assert metrics["num_requests"] == len(entries)
    assert metrics["total_output_tokens"] == sum(e.output_length for e in entries)
    assert metrics["prefix_hit_tokens"] > 0 and metrics["prefix_hit_rate"] > 0.3
