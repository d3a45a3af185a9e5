"""CUDA graphs for decode-only steps (CUDA only; opt in with ``LLM(cuda_graphs=True)``).

A decode step of a small model on a GPU is launch-bound: ~10 kernels per layer, each a few
microseconds of work, issued one by one from Python. Capturing the whole forward (all layers,
attention, LM head) once as a CUDA graph and replaying it makes the step one launch.

A graph replays fixed shapes and fixed addresses, so:

* **Batch buckets.** Decode batches are padded up to the next captured size
  (1, 2, 4, 8, 16, 32, ... and ``max_num_seqs`` itself: ``floor(log2(max_num_seqs)) + 2`` at most). A padding row *repeats the last real row*
  (same token, position, slot, block table, context length): it writes the very same K/V
  values into the very same slot, so it cannot corrupt the cache, and its logits are dropped.
  (A dedicated scratch slot would need a block the cache strategies do not reserve.)
* **Context buckets.** Gather backends size their work by ``metadata.max_context_len`` (a
  Python int), so graphs are also keyed by a context bucket: the next power of two of the
  step's longest context in tokens (at least 256), with the block-table width fixed to match,
  up to ``MAX_GRAPH_CONTEXT`` (4,096) tokens or the longest context a sequence can have,
  whichever is smaller: 256, 512, 1024, 2048, 4096, never up to ``max_model_len`` (Qwen2.5's
  32,768 would be 8 buckets per batch size). Shorter contexts are masked as usual
  (``context_lens`` is read from the static buffer); decode steps with a longer context run eagerly.
* **Static buffers.** ``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``,
  ``context_lens``, ``query_lens``, ``query_start_loc`` live in preallocated device tensors;
  each step copies its values in and replays; logits come out of a static ``[B, vocab]`` tensor.
* **Capture at start-up.** Every (batch, context) bucket is captured once, when the engine is
  built (:meth:`DecodeGraphs.capture_all`, largest first so smaller graphs reuse the memory
  pool), never inside a served step, whose time-to-first-token and time-per-token it would
  inflate. The capture runs on idle buffers: every row writes slot 0, harmless while no
  sequence holds a block. The graphs share one memory pool (they never run concurrently).
* **Rows.** A replay returns logits for every row of the step; the runner picks the sampled
  rows from them with the same function as the eager path (:func:`engine.runner.sampled_rows`).

Steps with more than one token for a sequence, and decode steps beyond the largest bucket, run eagerly.
"""
from __future__ import annotations

import torch

from engine.attention_metadata import AttentionMetadata


MAX_GRAPH_CONTEXT = 4096  # longest context bucket captured (tokens); longer decode steps run eagerly


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: the powers of two below ``max_num_seqs``, then ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def context_buckets(max_context: int, block_size: int, min_bucket: int = 256,
                    max_bucket: int = MAX_GRAPH_CONTEXT) -> list[int]:
    """Context buckets in tokens, each a whole number of blocks: ``min_bucket`` doubled until it
    covers ``min(max_context, max_bucket)``; the last is cut to that limit (rounded up to a block)."""
    if max_context < 1 or block_size < 1:
        raise ValueError(f"max_context and block_size must be >= 1, got {max_context} and {block_size}")
    limit = min(max_context, max_bucket)
    top = -(-limit // block_size) * block_size
    buckets, bucket = [], min_bucket
    while True:
        rounded = min(-(-bucket // block_size) * block_size, top)
        if not buckets or rounded > buckets[-1]:
            buckets.append(rounded)
        if bucket >= limit:
            return buckets
        bucket *= 2


class DecodeGraphs:
    """Captured decode forwards keyed by (padded batch, context bucket)."""

    def __init__(self, model, kv_caches, attention, device: torch.device, max_num_seqs: int,
                 block_size: int, max_context: int, min_context_bucket: int = 256) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches, self.attention, self.device = model, kv_caches, attention, device
        self.block_size = block_size
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.context_sizes = context_buckets(max_context, block_size, min_context_bucket)
        self.max_batch = self.batch_sizes[-1]
        max_blocks = self.context_sizes[-1] // block_size
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
        return next((size for size in self.context_sizes if size >= max_context_len), None)

    def keys(self) -> list[tuple[int, int]]:
        """Every (batch, context) bucket, the largest first: what :meth:`capture_all` captures."""
        return [(b, c) for b in reversed(self.batch_sizes) for c in reversed(self.context_sizes)]

    def can_run(self, metadata: AttentionMetadata) -> bool:
        if not metadata.is_decode_only:
            return False
        key = (self.padded_batch(metadata.num_seqs), self.context_bucket(metadata.max_context_len))
        return key in self.graphs

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
        """Capture the decode forward for ``batch`` rows and a ``context``-token bucket, on the
        current static buffers (idle at start-up: the K/V writes go to slot 0)."""
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

    def capture_all(self) -> None:
        """Capture every bucket of :meth:`keys` (at start-up, before any sequence holds a block)."""
        with torch.cuda.device(self.device):
            for batch, context in self.keys():
                self.capture(batch, context)

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
        graph, logits = self.graphs[(batch, context)]  # can_run checked it was captured
        graph.replay()
        return logits[:num_seqs]
