"""``workload=dataset``: prompts from a dataset file, as ``vllm bench serve --dataset-name sharegpt|custom``.

Two formats, picked by the file's extension (or ``format``):

* **ShareGPT** (``.json``): one JSON array of conversations, each
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``.
  The first human turn is the prompt; the gpt turn after it is the reference answer, whose token
  count is the request's output length (what vLLM does), unless ``output_len`` fixes it.
* **JSONL** (``.jsonl``): one object per line, ``{"prompt": "...", "output_len": 128}``, the
  output length optional (then ``output_len`` must fix it).

Sampling is seeded: the entries are shuffled with ``seed``, then kept in that order while they
pass the length filters (prompt tokens in ``[min_prompt_len, max_prompt_len]``, output at least
``min_output_len``, prompt + output at most ``max_total_len``; vLLM's ShareGPT filter is 4 /
1024 / 4 / 2048), until ``num_requests`` are taken. When fewer entries pass than are asked
for, the kept ones are reused in the same order (with a warning), as vLLM oversamples.

Prompts are text: encoded by the model's tokenizer, or one stand-in token per word without one
(:mod:`experiments.harness.text_tokens`); ``chat_template: true`` sends each prompt as a user
message through the chat template instead of as raw text. A damaged file fails with a
``ValueError`` naming the file, the line and the field (:mod:`experiments.harness.record_files`).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.tokenizer import encode_chat
from experiments.harness.record_files import Where, field, json_array_records, jsonl_records
from experiments.harness.text_tokens import Encoder, text_encoder
from experiments.harness.workloads import WorkloadRequest, _name, _params, gamma_arrival_offsets

log = logging.getLogger(__name__)
DATA_DIR = Path(__file__).resolve().parent / "data"
SAMPLE_DATASET = DATA_DIR / "sample_sharegpt.json"
HUMAN, GPT = "human", "gpt"


@dataclass(frozen=True)
class DatasetEntry:
    """One prompt of a dataset file: its text, and its output length from the data if it has one
    (``output_len``, or ``completion`` text to be counted in tokens)."""

    where: Where
    prompt: str
    output_len: int | None = None
    completion: str | None = None


def sharegpt_entries(path: str | Path) -> Iterator[DatasetEntry]:
    """The first human turn (and the gpt turn after it) of every ShareGPT conversation."""
    for where, record in json_array_records(path):
        turns = field(record, "conversations", list, where)
        if not turns:
            raise ValueError(f"{where}: field 'conversations' is empty")
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise ValueError(f"{where}: field 'conversations[{i}]' must be an object, got {turn!r}")
            speaker = field(turn, "from", str, where)
            if speaker not in (HUMAN, GPT):
                raise ValueError(f"{where}: field 'conversations[{i}].from' must be 'human' or 'gpt', got {speaker!r}")
            field(turn, "value", str, where)
        first_human = next((i for i, turn in enumerate(turns) if turn["from"] == HUMAN), None)
        if first_human is None:
            raise ValueError(f"{where}: field 'conversations' has no 'human' turn")
        answer = turns[first_human + 1] if first_human + 1 < len(turns) else None
        yield DatasetEntry(where, turns[first_human]["value"],
                           completion=answer["value"] if answer is not None and answer["from"] == GPT else None)


def jsonl_entries(path: str | Path) -> Iterator[DatasetEntry]:
    """``prompt`` and optional ``output_len`` of every line."""
    for where, record in jsonl_records(path):
        yield DatasetEntry(where, field(record, "prompt", str, where),
                           output_len=field(record, "output_len", int, where, required=False, minimum=1))


def load_entries(path: str | Path, format: str = "auto") -> list[DatasetEntry]:
    """Every entry of a dataset file; ``format``: ``auto`` (by extension), ``sharegpt`` or ``jsonl``."""
    path = Path(path)
    if format == "auto":
        format = {".json": "sharegpt", ".jsonl": "jsonl"}.get(path.suffix)
        if format is None:
            raise ValueError(f"{path}: cannot tell the dataset format from the extension {path.suffix!r}; "
                             "use .json (ShareGPT) or .jsonl, or set workload.format")
    readers = {"sharegpt": sharegpt_entries, "jsonl": jsonl_entries}
    if format not in readers:
        raise ValueError(f"workload.format must be auto, sharegpt or jsonl, got {format!r}")
    return list(readers[format](path))


@dataclass(frozen=True)
class LengthFilter:
    """Which entries a dataset run keeps (lengths in tokens)."""

    min_prompt_len: int = 4
    max_prompt_len: int = 1024
    min_output_len: int = 4
    max_total_len: int = 2048

    def keeps(self, prompt_len: int, output_len: int) -> bool:
        return (self.min_prompt_len <= prompt_len <= self.max_prompt_len and output_len >= self.min_output_len
                and prompt_len + output_len <= self.max_total_len)


def entry_output_len(entry: DatasetEntry, encode: Encoder, fixed: int | None) -> int:
    """The request's output length: ``fixed``, else the data's (``output_len`` or the answer's tokens)."""
    if fixed is not None:
        return fixed
    if entry.output_len is not None:
        return entry.output_len
    if entry.completion is not None:
        return len(encode(entry.completion))
    missing = "output_len" if entry.completion is None and entry.output_len is None else "conversations"
    raise ValueError(f"{entry.where}: field {missing!r} (the output length) is missing and workload.output_len "
                     "is null; give every record one or set workload.output_len")


def dataset(
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    tokenizer: Any | None = None,
    seed: int = 0,
    path: str | None = None,
    format: str = "auto",
    num_requests: int = 16,
    output_len: int | None = None,
    min_prompt_len: int = 4,
    max_prompt_len: int = 1024,
    min_output_len: int = 4,
    max_total_len: int = 2048,
    chat_template: bool = False,
    concurrency: int | None = None,
    rate: float = float("inf"),
    burstiness: float = 1.0,
    ignore_eos: bool = True,
    temperature: float = 0.0,
) -> list[WorkloadRequest]:
    """``num_requests`` prompts sampled (seeded) from ``path`` (default: the bundled sample),
    arriving at ``rate`` req/s; see the module docstring. ``concurrency`` is the driver's cap."""
    del concurrency
    if num_requests < 1:
        raise ValueError(f"workload.num_requests must be >= 1, got {num_requests}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"workload.output_len must be >= 1 or null, got {output_len}")
    file = Path(path) if path is not None else SAMPLE_DATASET
    entries = load_entries(file, format)
    encode = text_encoder(tokenizer, vocab_size, special_token_ids)
    keep = LengthFilter(min_prompt_len, max_prompt_len, min_output_len, max_total_len)
    chosen: list[tuple[DatasetEntry, list[int], int]] = []
    for index in np.random.default_rng(seed).permutation(len(entries)):
        entry = entries[index]
        messages = ({"role": "user", "content": entry.prompt},) if chat_template else ()
        prompt = encode_chat(tokenizer, messages) if chat_template else encode(entry.prompt)
        out = entry_output_len(entry, encode, output_len)
        if keep.keeps(len(prompt), out):
            chosen.append((entry, prompt, out))
        if len(chosen) == num_requests:
            break
    if not chosen:
        raise ValueError(f"{file}: none of its {len(entries)} entries passes the length filters {keep}")
    if len(chosen) < num_requests:
        log.warning("%s: %d of %d entries pass the length filters; reusing them for %d requests",
                    file, len(chosen), len(entries), num_requests)
    offsets = gamma_arrival_offsets(num_requests, rate, burstiness, np.random.default_rng([seed, 1]))
    requests = []
    for i, offset in enumerate(offsets):
        entry, prompt, out = chosen[i % len(chosen)]
        messages = ({"role": "user", "content": entry.prompt},) if chat_template else ()
        requests.append(WorkloadRequest(_name(i), prompt, _params(out, ignore_eos, temperature), offset, messages))
    return requests
