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
from strategies.attention.base import AttentionBackend
from strategies.cache.base import KVCacheStrategy
from strategies.scheduler.base import ScheduledSequence


@dataclass
class StepInputs:
    """Everything one forward pass needs, plus which rows to sample from.

    Attributes:
        input_ids: ``[T]`` token ids of the new rows.
        positions: ``[T]`` their positions in their sequences.
        metadata: the attention metadata of the step.
        logits_indices: ``[S]`` rows whose next-token logits are needed.
        sampled: the scheduled items those rows belong to, in the same order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[ScheduledSequence]


class ModelRunner:
    """Owns the model, the KV tensors (through the cache strategy) and the attention backend."""

    def __init__(
        self, model: torch.nn.Module, cache: KVCacheStrategy, attention: AttentionBackend, device: torch.device
    ) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        self.device = device

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepInputs:
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
            end = start + item.num_new_tokens
            token_ids.extend(seq.token_ids[start:end])
            start_positions.append(start)
            query_lens.append(item.num_new_tokens)
            block_tables.append(seq.block_table)
            if end == seq.num_tokens:
                sampled.append(item)
                sampled_rows.append(len(token_ids) - 1)

        block_size = self.cache.block_size
        max_blocks = max(len(table) for table in block_tables)
        block_tables_tensor = torch.tensor(
            [table + [0] * (max_blocks - len(table)) for table in block_tables], dtype=torch.int64
        )
        query_lens_tensor = torch.tensor(query_lens, dtype=torch.int64)
        starts_tensor = torch.tensor(start_positions, dtype=torch.int64)
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(query_lens_tensor, 0, out=query_start_loc[1:])
        num_rows = len(token_ids)
        row_to_seq = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens_tensor, output_size=num_rows)
        offset_in_query = torch.arange(num_rows) - query_start_loc[:-1][row_to_seq]
        positions = starts_tensor[row_to_seq] + offset_in_query
        slot_mapping = block_tables_tensor[row_to_seq, positions // block_size] * block_size + positions % block_size
        context_lens = starts_tensor + query_lens_tensor

        device = self.device
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc.to(device, torch.int32),
            query_lens=query_lens_tensor.to(device, torch.int32),
            context_lens=context_lens.to(device, torch.int32),
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables_tensor.to(device, torch.int32),
            block_size=block_size,
            max_query_len=max(query_lens),
            max_context_len=int(context_lens.max()),
        )
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64).to(device),
            positions=positions.to(device),
            metadata=metadata,
            logits_indices=torch.tensor(sampled_rows, dtype=torch.int64).to(device),
            sampled=sampled,
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """One forward pass; returns float32 logits ``[S, vocab]`` for the sampled rows."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.cache.kv_caches, inputs.metadata, self.attention)
        return self.model.compute_logits(hidden[inputs.logits_indices])
