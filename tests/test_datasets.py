"""workload=dataset: ShareGPT and JSONL files, seeded sampling, length filters, output lengths,
and a ValueError naming file, line and field for every kind of damaged input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.harness.datasets import DATA_DIR, SAMPLE_DATASET, dataset, load_entries
from tests.harness_runs import SIMULATED_TINY, run_once

VOCAB, SPECIAL = 512, (0, 1, 2)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_bundled_samples_load_in_both_formats() -> None:
    sharegpt = load_entries(SAMPLE_DATASET)
    jsonl = load_entries(DATA_DIR / "sample_prompts.jsonl")
    assert len(sharegpt) >= 20 and all(e.prompt and e.completion for e in sharegpt)
    assert len(jsonl) >= 10 and all(e.output_len for e in jsonl)
    assert sharegpt[1].where.line > sharegpt[0].where.line  # each entry knows its own line


def test_sampling_is_seeded_and_output_lengths_come_from_the_data() -> None:
    first, again, other = (dataset(VOCAB, SPECIAL, seed=s, num_requests=8) for s in (0, 0, 1))
    assert first == again and first != other
    entries = {e.prompt: e for e in load_entries(SAMPLE_DATASET)}
    # output length = stand-in tokens (one per word) of the gpt answer after the prompt
    from experiments.harness.text_tokens import text_encoder
    encode = text_encoder(None, VOCAB, SPECIAL)
    by_ids = {tuple(encode(p)): e for p, e in entries.items()}
    for request in first:
        entry = by_ids[tuple(request.prompt_token_ids)]
        assert request.sampling_params.max_tokens == len(entry.completion.split())
    jsonl = dataset(VOCAB, SPECIAL, path=str(DATA_DIR / "sample_prompts.jsonl"), num_requests=5, min_output_len=1)
    lengths = {e.prompt: e.output_len for e in load_entries(DATA_DIR / "sample_prompts.jsonl")}
    assert all(r.sampling_params.max_tokens in lengths.values() for r in jsonl)


def test_length_filters_and_fixed_output_length() -> None:
    requests = dataset(VOCAB, SPECIAL, num_requests=30, min_prompt_len=8, max_prompt_len=10, output_len=7)
    assert all(8 <= len(r.prompt_token_ids) <= 10 for r in requests)
    assert all(r.sampling_params.max_tokens == 7 for r in requests)
    assert len({tuple(r.prompt_token_ids) for r in requests}) < 30  # fewer pass than asked: reused
    with pytest.raises(ValueError, match="none of its .* entries passes the length filters"):
        dataset(VOCAB, SPECIAL, min_prompt_len=500)


def test_rate_spreads_arrivals() -> None:
    requests = dataset(VOCAB, SPECIAL, num_requests=10, rate=5.0)
    offsets = [r.arrival_offset_s for r in requests]
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets[-1] > 0


@pytest.mark.parametrize("name, text, message", [
    ("empty.jsonl", "\n\n", r"empty\.jsonl: the file is empty"),
    ("bad.jsonl", '{"prompt": "a b c d", "output_len": 4}\n{"prompt": "x y"\n', r"bad\.jsonl:2: not valid JSON"),
    ("missing.jsonl", '{"prompt": "a b c d"}\n{"output_len": 5}\n', r"missing\.jsonl:2: field 'prompt' is missing"),
    ("type.jsonl", '{"prompt": "a b c d", "output_len": "12"}\n', r"type\.jsonl:1: field 'output_len' must be an integer"),
    ("list.jsonl", '[1, 2]\n', r"list\.jsonl:1: expected a JSON object"),
    ("empty.json", "[]", r"empty\.json: the JSON array is empty"),
    ("open.json", '[{"conversations": [{"from": "human", "value": "hi"}]},\n', r"open\.json:2: not valid JSON"),
    ("speaker.json", '[\n{"conversations": [{"from": "human", "value": "hi"}]},\n{"conversations": [{"from": "bot", "value": "x"}]}\n]',
     r"speaker\.json:3: field 'conversations\[0\]\.from' must be 'human' or 'gpt'"),
    ("noconv.json", '[\n {"id": 1}\n]', r"noconv\.json:2: field 'conversations' is missing"),
])
def test_damaged_files_name_file_line_and_field(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataset(VOCAB, SPECIAL, path=str(write(tmp_path / name, text)), min_prompt_len=1, min_output_len=1)


def test_a_missing_output_length_names_the_line_unless_fixed(tmp_path: Path) -> None:
    file = write(tmp_path / "d.jsonl", '{"prompt": "one two three four", "output_len": 5}\n{"prompt": "five six seven eight"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: field 'output_len' \(the output length\) is missing"):
        dataset(VOCAB, SPECIAL, path=str(file), num_requests=2)
    assert len(dataset(VOCAB, SPECIAL, path=str(file), num_requests=2, output_len=5)) == 2
    with pytest.raises(ValueError, match="cannot tell the dataset format"):
        dataset(VOCAB, SPECIAL, path=str(write(tmp_path / "d.txt", "x")))


def test_a_dataset_run_end_to_end_on_the_simulator(tmp_path: Path) -> None:
    outcome = run_once([*SIMULATED_TINY, "workload=dataset", "workload.num_requests=6"], tmp_path)
    assert outcome.summary["status"] == "ok", outcome.summary.get("error")
    metrics = outcome.summary["metrics"]
    assert metrics["num_requests"] == 6
    chosen = dataset(VOCAB, SPECIAL, num_requests=6)
    assert metrics["total_output_tokens"] == sum(r.sampling_params.max_tokens for r in chosen)
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["workload"] == "dataset"
