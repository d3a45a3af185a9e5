"""The model runner: turns one scheduled step into one flat forward pass.

All sequences of a step — whole prompts, prefill chunks, single decode tokens — are
concatenated into one varlen batch of ``T`` token rows. Besides ``input_ids`` and
``positions`` the runner builds the attention metadata as tensors:

* ``slot_mapping[t]``: where row ``t``'s new K/V is written,
  ``block_table[pos // block_size] * block_size + pos % block_size``;
* ``block_tables``: every sequence's page table, padded into one ``[B, max_blocks]`` tensor;
* ``context_lens`` / ``query_start_loc``: how much each sequence attends over, and its rows.

Only rows that end a sequence's uncomputed tokens produce logits (a prefill chunk that stops
mid-prompt samples nothing), so the LM head runs on ``B`` rows, not ``T``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention_metadata import AttentionMetadata
from engine.interfaces.attention import AttentionBackend
from engine.interfaces.cache import KVCacheStrategy
from engine.interfaces.scheduler import ScheduledSequence
from engine.step_shape import MIN_DECODE_RUN, attention_runs
from engine.step_staging import HostStaging


@dataclass
class StepInputs:
    """Everything one forward pass needs, plus which rows to sample from.

    Attributes:
        input_ids: ``[T]`` token ids of the new rows.
        positions: ``[T]`` their positions in their sequences.
        metadata: the attention metadata of the step.
        logits_indices: ``[S]`` rows whose next-token logits are needed.
        sampled: the scheduled items those rows belong to, in the same order.
        attention_parts: for mixed steps, ``(row_start, row_end, metadata)`` per run of decode /
            prefill sequences (see :meth:`ModelRunner.split_runs`); ``None`` otherwise.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[ScheduledSequence]
    attention_parts: list[tuple[int, int, AttentionMetadata]] | None = None


class ModelRunner:
    """Owns the model, the KV tensors (through the cache strategy) and the attention backend."""

    def __init__(
        self, model: torch.nn.Module, cache: KVCacheStrategy, attention: AttentionBackend, device: torch.device
    ) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        self.device = device
        self._aranges = torch.arange(1024, dtype=torch.int64)
        # CUDA: the step's metadata goes through pinned buffers, one non-blocking copy per dtype
        self.staging = HostStaging(device, pin_memory=True) if device.type == "cuda" else None
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs when LLM(cuda_graphs=True) on CUDA
        self.min_decode_run: int | None = MIN_DECODE_RUN  # split mixed steps with a run of >= this many decodes; None: never

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepInputs:
        """Flatten one step. Python touches each sequence once (its token ids, start and block
        table); everything derived (positions, slots, prefix sums) is tensor ops on the host,
        then to the device (:meth:`_to_device`). Decode-only steps (one row per sequence) skip
        the ragged-row bookkeeping entirely."""
        token_ids: list[int] = []
        start_positions: list[int] = []
        query_lens: list[int] = []
        block_tables: list[list[int]] = []
        sampled: list[ScheduledSequence] = []
        sampled_rows: list[int] = []
        for item in scheduled:
            seq = item.seq
            # A padding row (finished member of a static batch) recomputes its last token.
            start = seq.num_tokens - 1 if item.is_padding else seq.num_computed_tokens
            num_new = item.num_new_tokens
            end = start + num_new
            if num_new == 1:
                token_ids.append(seq.token_ids[start])
            else:
                token_ids.extend(seq.token_ids[start:end])
            start_positions.append(start)
            query_lens.append(num_new)
            block_tables.append(seq.block_table)
            if end == seq.num_tokens:
                sampled.append(item)
                sampled_rows.append(len(token_ids) - 1)

        num_seqs, num_rows = len(scheduled), len(token_ids)
        block_size = self.cache.block_size
        max_blocks = max(len(table) for table in block_tables)
        # One host tensor for the ragged ints (ids | starts | query lens | sampled rows).
        ints = torch.tensor(token_ids + start_positions + query_lens + sampled_rows, dtype=torch.int64)
        input_ids, starts, query_lens_t, logits_indices = ints.split(
            [num_rows, num_seqs, num_seqs, len(sampled_rows)]
        )
        block_tables_t = torch.tensor(
            [table + [0] * (max_blocks - len(table)) for table in block_tables], dtype=torch.int64
        )
        decode_only = num_rows == num_seqs
        if decode_only:
            positions = starts
            query_start_loc = self._arange(num_seqs + 1)
            seq_rows = self._arange(num_seqs)
        else:
            query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)
            torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
            seq_rows = torch.repeat_interleave(self._arange(num_seqs), query_lens_t, output_size=num_rows)
            positions = starts[seq_rows] + (self._arange(num_rows) - query_start_loc[:-1][seq_rows])
        slot_mapping = block_tables_t[seq_rows, positions // block_size] * block_size + positions % block_size
        context_lens = starts + query_lens_t

        (input_ids, positions, logits_indices, slot_mapping, query_start_loc, query_lens_t, context_lens,
         block_tables_t) = self._to_device([
            (input_ids, torch.int64), (positions, torch.int64), (logits_indices, torch.int64),
            (slot_mapping, torch.int64), (query_start_loc, torch.int32), (query_lens_t, torch.int32),
            (context_lens, torch.int32), (block_tables_t, torch.int32)])
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            query_lens=query_lens_t,
            context_lens=context_lens,
            slot_mapping=slot_mapping,
            block_tables=block_tables_t,
            block_size=block_size,
            max_query_len=max(query_lens),
            max_context_len=max(start + n for start, n in zip(start_positions, query_lens)),
        )
        parts = None if decode_only else self.split_runs(metadata, query_lens, start_positions)
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            metadata=metadata,
            logits_indices=logits_indices,
            sampled=sampled,
            attention_parts=parts,
        )

    def split_runs(
        self, metadata: AttentionMetadata, query_lens: list[int], starts: list[int]
    ) -> list[tuple[int, int, AttentionMetadata]] | None:
        """Split a mixed step into runs of decode (1-row) and prefill sequences.

        The scheduler lists running sequences (mostly decodes) before new admissions (prompts),
        so a mixed step is usually two runs. Attending per run keeps the decode rows on the
        backend's unpadded decode path; in one padded call every decode row would be padded to
        the longest prompt (31 decodes + one 124-token prompt, SmolLM2-135M on 2 CPU cores: 1130 ms
        -> 581 ms per step; docs/performance.md, section 3.7).
        Returns ``None`` when splitting does not pay (a single run, or runs shorter than
        ``min_decode_run`` decode sequences): the rule is :func:`engine.step_shape.attention_runs`,
        which the step shape also uses to count the padded attention pairs.
        """
        runs = attention_runs(query_lens, self.min_decode_run)
        if len(runs) == 1:
            return None
        parts = []
        row = 0
        qsl = metadata.query_start_loc
        for s, e in runs:
            rows = sum(query_lens[s:e])
            part = AttentionMetadata(
                query_start_loc=qsl[s : e + 1] - row,
                query_lens=metadata.query_lens[s:e],
                context_lens=metadata.context_lens[s:e],
                slot_mapping=metadata.slot_mapping[row : row + rows],
                block_tables=metadata.block_tables[s:e],
                block_size=metadata.block_size,
                max_query_len=max(query_lens[s:e]),
                max_context_len=max(starts[i] + query_lens[i] for i in range(s, e)),
            )
            parts.append((row, row + rows, part))
            row += rows
        return parts

    def _to_device(self, tensors: list[tuple[torch.Tensor, torch.dtype]]) -> list[torch.Tensor]:
        """The step's host tensors on the device, each in its dtype: on CUDA through the pinned
        staging buffers (one non-blocking copy per dtype, :mod:`engine.step_staging`), elsewhere
        ``tensor.to(device, dtype)`` (on the CPU mostly no copy at all)."""
        if self.staging is not None:
            return self.staging.stage(tensors)
        return [tensor.to(self.device, dtype) for tensor, dtype in tensors]

    def _arange(self, n: int) -> torch.Tensor:
        """``arange(n)`` as a view of one cached host tensor (grown on demand, never written)."""
        if self._aranges.numel() < n:
            self._aranges = torch.arange(max(n, 2 * self._aranges.numel()), dtype=torch.int64)
        return self._aranges[:n]

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """One forward pass; returns float32 logits ``[S, vocab]`` for the sampled rows, in the
        order of ``inputs.sampled``, on both paths: :func:`sampled_rows` picks them from the
        hidden states (eager: the LM head runs on ``S`` rows) or from a replayed graph's logits
        (a graph computes every row: a step of one-token rows may hold a one-token prompt chunk,
        which is not sampled, at any place the scheduler's policy puts it)."""
        if self.graphs is not None and self.graphs.can_run(inputs.metadata):
            return sampled_rows(self.graphs.run(inputs.input_ids, inputs.positions, inputs.metadata), inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, self.cache.kv_caches, inputs.metadata, self.attention,
                            attention_parts=inputs.attention_parts)
        return self.model.compute_logits(sampled_rows(hidden, inputs))

    def enable_cuda_graphs(self, max_num_seqs: int, max_context: int) -> None:
        """Capture the decode graphs now, at start-up (see :mod:`engine.cuda_graphs` for the
        buckets), so that no capture ever lands inside a timed step."""
        from engine.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.cache.kv_caches, self.attention, self.device,
                                   max_num_seqs=max_num_seqs, block_size=self.cache.block_size, max_context=max_context)
        self.graphs.capture_all()


def sampled_rows(rows: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
    """The rows of a step's per-row tensor (hidden states or logits, ``[T, ...]``) that are
    sampled, in the order of ``inputs.sampled``: rows ``inputs.logits_indices``. The only
    place the runner chooses rows, for the eager and the graph path alike."""
    return rows.index_select(0, inputs.logits_indices)
