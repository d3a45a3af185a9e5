"""Prompt chunks' attention in bfloat16 through torch's flash-attention kernel, over the paged cache.

A decode row's attention is a read of its context: one query vector against every cached key,
bound by the bytes of K/V (``csrc/paged_attention.c`` reads them in place, in float32
arithmetic). A prompt chunk of ``q`` rows over a context of ``n`` tokens is two matmuls per head
instead, ``Q K^T`` (``q x n``) and ``P V``, about ``4 q n d`` multiply-adds per head: for a
1,024-token prompt that is most of its prefill time once the linears run in bfloat16 (on a
2-core Xeon with AMX, 0.36 of 0.66 s in the float32 C kernel; docs/decisions.md, decision 23).

On a CPU with AMX those matmuls are what the tile unit is for. torch's CPU flash-attention kernel
(``F.scaled_dot_product_attention`` on bfloat16 inputs) runs them as oneDNN bfloat16 micro-GEMMs,
with the softmax in float32 blocks, as vLLM's CPU backend computes a bf16 model's prefill. This
module feeds it from the paged bfloat16 cache:

* the chunk's queries are rounded to bfloat16 (the keys and values already are: this path needs
  ``kv_cache_dtype=bfloat16``);
* each prompt's context is gathered from its blocks into one ``[kv_heads, n, head_dim]`` tensor
  per layer (``n x kv_heads x head_dim x 2`` bytes each for K and V, 0.75 KB per token on
  SmolLM2-135M: a fused kernel that read the blocks in place, as the decode kernel does, would
  skip this copy);
* a chunk that starts after earlier tokens (chunked prefill, a prefix-cache hit) attends causally
  from its offset: row ``j`` sees keys ``<= n - q + j``, a boolean mask built once per step; a
  chunk that is the whole context takes the kernel's own causal mode;
* the query heads share their KV head (grouped-query attention) inside the kernel
  (``enable_gqa``), with no repeated K/V.

Sequences with few new tokens or a short context stay on the C kernel (:class:`PromptSplit`):
for a decode row the work is a read, not a matmul, and the C kernel reads the blocks in place;
below ~16K query-key pairs the flash path's fixed cost per call (the gather, the dispatch) is
more than the matmuls save. The result differs from
the float32 kernel's by the bfloat16 rounding of the queries and of the softmax weights before
``P V`` (measured in decision 23).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata

@dataclass(frozen=True)
class PromptSplit:
    """Which sequences attend here: at least ``min_rows`` new tokens, ``min_context`` context tokens
    and ``min_pairs`` query-key pairs (new tokens x context tokens). The defaults are where this
    path overtook the C kernel on a 2-core Xeon with AMX (``python -m
    experiments.bench.prompt_attention``: 1.4-3.1x from 32 x 512 and 64 x 256 up, 1.08-1.09x at 128 x
    128 and 16 x 1,024, 0.73x at 64 x 64; decision 23). A step none of whose sequences this path
    takes may run whole layers in C (:mod:`engine.native_layers`), which 128-token prompts gain
    more from than from this path: hence ``min_context``."""

    min_rows: int = 16
    min_context: int = 256
    min_pairs: int = 16384

    def __post_init__(self) -> None:
        if min(self.min_rows, self.min_context, self.min_pairs) < 1:
            raise ValueError(f"min_rows, min_context and min_pairs must be at least 1, got {self.min_rows}, "
                             f"{self.min_context} and {self.min_pairs}")

    def takes(self, query_len: int, context_len: int) -> bool:
        return (query_len >= self.min_rows and context_len >= self.min_context
                and query_len * context_len >= self.min_pairs)


@dataclass(frozen=True)
class PromptChunk:
    """One sequence's prompt chunk in a step: its query rows and where its context lies."""

    rows: slice  # its rows of the step's flattened query / output
    slots: torch.Tensor  # int64 [n]: the cache slot of each context position, in order
    mask: torch.Tensor | None  # bool [q, n], True where row j may attend; None: the whole context is this chunk


@dataclass(frozen=True)
class PromptPlan:
    """How one step's sequences split between the C kernel and this path (built once per step)."""

    kernel_runs: tuple[tuple[int, int], ...]  # [first, last) sequence ranges the C kernel attends
    chunks: tuple[PromptChunk, ...]  # the sequences attended here


def plan(metadata: AttentionMetadata, split: PromptSplit) -> PromptPlan:
    """The step's split: the sequences ``split`` takes here, the rest in contiguous runs for the C kernel."""
    query_lens = metadata.query_lens.tolist()
    context_lens = metadata.context_lens.tolist()
    starts = metadata.query_start_loc.tolist()
    runs: list[tuple[int, int]] = []
    chunks: list[PromptChunk] = []
    block_size = metadata.block_size
    for seq, (query_len, context_len) in enumerate(zip(query_lens, context_lens)):
        if not split.takes(query_len, context_len):
            if runs and runs[-1][1] == seq:
                runs[-1] = (runs[-1][0], seq + 1)
            else:
                runs.append((seq, seq + 1))
            continue
        positions = torch.arange(context_len, dtype=torch.int64)
        blocks = metadata.block_tables[seq, : -(-context_len // block_size)].to(torch.int64)
        slots = blocks.repeat_interleave(block_size)[:context_len] * block_size + positions % block_size
        mask = None
        if context_len != query_len:
            offset = context_len - query_len
            mask = positions[None, :] <= (torch.arange(query_len, dtype=torch.int64)[:, None] + offset)
        chunks.append(PromptChunk(slice(starts[seq], starts[seq + 1]), slots, mask))
    return PromptPlan(tuple(runs), tuple(chunks))


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PromptChunk,
           scale: float, out: torch.Tensor) -> None:
    """``out[chunk.rows] =`` attention of ``query[chunk.rows] [q, Hq, D]`` (float32) over the chunk's
    context in the bfloat16 caches ``[blocks, block_size, kv_heads, D]``, computed in bfloat16."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # The gather a fused kernel would replace: the context's K/V rows out of their blocks.
    keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, chunk.slots).transpose(0, 1)
    values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, chunk.slots).transpose(0, 1)
    queries = query[chunk.rows].to(torch.bfloat16).transpose(0, 1)
    result = F.scaled_dot_product_attention(
        queries.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=chunk.mask,
        is_causal=chunk.mask is None, scale=scale, enable_gqa=True,
    )
    out[chunk.rows] = result[0].transpose(0, 1)
