"""CUDA graphs for decode-only steps (CUDA only; opt in with ``LLM(cuda_graphs=True)``).

A decode step of a small model on a GPU is launch-bound: ~10 kernels per layer, each a few
microseconds of work, issued one by one from Python. Capturing the whole forward (all layers,
attention, LM head) once as a CUDA graph and replaying it makes the step one launch.

A graph replays fixed shapes and fixed addresses, so:

* **Batch buckets.** Decode batches are padded up to the next captured size
  (1, 2, 4, 8, 16, 32, ... up to ``max_num_seqs``). A padding row *repeats the last real row*
  (same token, position, slot, block table, context length): it writes the very same K/V
  values into the very same slot, so it cannot corrupt the cache, and its logits are dropped.
  (A dedicated scratch slot would need a block the cache strategies do not reserve.)
* **Context buckets.** Gather backends size their work by ``metadata.max_context_len`` (a
  Python int), so graphs are also keyed by a context bucket: the next power of two of the
  step's longest context in tokens (at least 256), with the block-table width fixed to match.
  Shorter contexts are masked as usual (``context_lens`` is read from the static buffer).
* **Static buffers.** ``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``,
  ``context_lens``, ``query_lens``, ``query_start_loc`` live in preallocated device tensors;
  each step copies its values in and replays; logits come out of a static ``[B, vocab]`` tensor.
* Graphs are captured lazily, the first time a (batch, context) bucket is needed (on that
  step's own buffers), and share one memory pool (they never run concurrently).

Steps with any prefill rows, and decode steps beyond the largest bucket, run eagerly.
"""
from __future__ import annotations

import torch

from engine.attention_metadata import AttentionMetadata


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Captured decode forwards keyed by (padded batch, context bucket)."""

    def __init__(self, model, kv_caches, attention, device: torch.device, max_num_seqs: int,
                 block_size: int, max_context: int, min_context_bucket: int = 256) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches, self.attention, self.device = model, kv_caches, attention, device
        self.block_size = block_size
        self.max_context = max_context
        self.min_context_bucket = min_context_bucket
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.max_batch = self.batch_sizes[-1]
        max_blocks = -(-max_context // block_size)
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(self.max_batch, **i64)
        self.positions = torch.zeros(self.max_batch, **i64)
        self.slot_mapping = torch.zeros(self.max_batch, **i64)
        self.context_lens = torch.ones(self.max_batch, **i32)
        self.block_tables = torch.zeros(self.max_batch, max_blocks, **i32)
        self.query_lens = torch.ones(self.max_batch, **i32)
        self.query_start_loc = torch.arange(self.max_batch + 1, **i32)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    # -- buckets ---------------------------------------------------------------------------
    def padded_batch(self, num_seqs: int) -> int | None:
        return next((size for size in self.batch_sizes if size >= num_seqs), None)

    def context_bucket(self, max_context_len: int) -> int | None:
        bucket = self.min_context_bucket
        while bucket < max_context_len:
            bucket *= 2
        bucket = -(-bucket // self.block_size) * self.block_size
        if max_context_len > self.max_context:
            return None
        return min(bucket, -(-self.max_context // self.block_size) * self.block_size)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (metadata.is_decode_only and self.padded_batch(metadata.num_seqs) is not None
                and self.context_bucket(metadata.max_context_len) is not None)

    # -- capture / replay -------------------------------------------------------------------
    def _metadata(self, batch: int, context: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1],
            query_lens=self.query_lens[:batch],
            context_lens=self.context_lens[:batch],
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch, : context // self.block_size],
            block_size=self.block_size,
            max_query_len=1,
            max_context_len=context,
        )

    def _forward(self, batch: int, context: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches,
                            self._metadata(batch, context), self.attention)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, batch: int, context: int) -> None:
        """Capture the decode forward for ``batch`` rows and a ``context``-token bucket.

        Capture runs the forward on the *current* static buffers, which :meth:`run` has just
        filled with a real step: the capture's K/V writes are that step's own."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on a side stream: allocator, cuBLAS / Triton autotune
                self._forward(batch, context)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(batch, context)
        self.graphs[(batch, context)] = (graph, logits)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits ``[B, vocab]`` of a decode-only step (rows in step order), via a graph."""
        num_seqs = metadata.num_seqs
        batch = self.padded_batch(num_seqs)
        context = self.context_bucket(metadata.max_context_len)
        width = context // self.block_size
        real_width = min(metadata.block_tables.shape[1], width)
        pad = batch - num_seqs
        # Real rows, then padding rows repeating the last real row.
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(metadata.slot_mapping)
        self.context_lens[:num_seqs].copy_(metadata.context_lens)
        tables = self.block_tables[:batch, :width]
        tables[:num_seqs].zero_()
        tables[:num_seqs, :real_width].copy_(metadata.block_tables[:, :real_width])
        if pad:
            for buffer in (self.input_ids, self.positions, self.slot_mapping, self.context_lens):
                buffer[num_seqs:batch].copy_(buffer[num_seqs - 1].expand(pad))
            tables[num_seqs:batch].copy_(tables[num_seqs - 1].expand(pad, width))
        key = (batch, context)
        if key not in self.graphs:
            self.capture(batch, context)  # captured on this very step's buffers: a real, harmless write
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:num_seqs]
