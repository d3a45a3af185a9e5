"""``workload=trace``: replay a timestamped request trace (Mooncake's format, vLLM's ``timed_trace``).

Each line of the JSONL file is one request::

    {"timestamp": 1520, "input_length": 700, "output_length": 40, "hash_ids": [0, 1, 7]}

``timestamp`` is in milliseconds; the request arrives ``(timestamp - first timestamp) / 1000 *
time_scale`` seconds after the run starts (``time_scale`` 0.5 replays twice as fast, 2 half as
fast). ``input_length`` / ``output_length`` are token counts (``ignore_eos`` keeps the output
exactly that long).

``hash_ids`` say which prompt blocks requests share: the prompt is the concatenation of one
``hash_block_size``-token block per hash id (Mooncake's traces use 512), each block's tokens
drawn from a generator seeded by ``(seed, hash id)``, so every request naming hash id 7 carries
the very same 7th block and a prefix cache sees the trace's real reuse. The blocks are cut to
``input_length``; a prompt longer than its blocks is completed with tokens of its own. Without
``hash_ids`` every prompt is its own.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.harness.datasets import DATA_DIR
from experiments.harness.record_files import Where, field, jsonl_records
from experiments.harness.workloads import TokenSampler, WorkloadRequest, _name, _params

SAMPLE_TRACE = DATA_DIR / "sample_trace.jsonl"


@dataclass(frozen=True)
class TraceEntry:
    """One line of a trace file."""

    where: Where
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


def load_trace(path: str | Path) -> list[TraceEntry]:
    """Every request of a trace file, in file order (checked: fields, types, bounds)."""
    entries = []
    for where, record in jsonl_records(path):
        hash_ids = field(record, "hash_ids", list, where, required=False) or []
        for i, value in enumerate(hash_ids):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: field 'hash_ids[{i}]' must be a non-negative integer, got {value!r}")
        entries.append(TraceEntry(
            where, float(field(record, "timestamp", float, where, minimum=0)),
            field(record, "input_length", int, where, minimum=1), field(record, "output_length", int, where, minimum=1),
            tuple(hash_ids)))
    return entries


class BlockTokens:
    """The tokens of each shared prompt block: a pure function of ``(seed, hash id)``."""

    def __init__(self, vocab_size: int, special_token_ids: Sequence[int], seed: int, block_size: int) -> None:
        self.allowed = TokenSampler(vocab_size, special_token_ids, seed).allowed
        self.seed, self.block_size = seed, block_size
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        if hash_id not in self._blocks:
            rng = np.random.default_rng([self.seed, 3, hash_id])
            self._blocks[hash_id] = self.allowed[rng.integers(0, self.allowed.size, self.block_size)].tolist()
        return self._blocks[hash_id]


def trace(
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    seed: int = 0,
    path: str | None = None,
    time_scale: float = 1.0,
    hash_block_size: int = 64,
    max_requests: int | None = None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
) -> list[WorkloadRequest]:
    """The requests of the trace at ``path`` (default: the bundled sample), arriving on its clock
    scaled by ``time_scale``; the first ``max_requests`` by time when given. See the module docstring."""
    if time_scale <= 0:
        raise ValueError(f"workload.time_scale must be > 0, got {time_scale}")
    if hash_block_size < 1:
        raise ValueError(f"workload.hash_block_size must be >= 1, got {hash_block_size}")
    entries = sorted(load_trace(path if path is not None else SAMPLE_TRACE), key=lambda e: e.timestamp_ms)
    if max_requests is not None:
        entries = entries[:max_requests]
    blocks = BlockTokens(vocab_size, special_token_ids, seed, hash_block_size)
    own = TokenSampler(vocab_size, special_token_ids, seed)
    start = entries[0].timestamp_ms
    requests = []
    for i, entry in enumerate(entries):
        prompt = [token for hash_id in entry.hash_ids for token in blocks.block(hash_id)][: entry.input_length]
        prompt += own.tokens(entry.input_length - len(prompt))
        offset = (entry.timestamp_ms - start) / 1000.0 * time_scale
        requests.append(WorkloadRequest(_name(i), prompt, _params(entry.output_length, ignore_eos, temperature), offset))
    return requests
