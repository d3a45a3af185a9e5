"""``eager``: gather the paged context, then matmul -> masked float32 softmax -> matmul.

The textbook attention, written out so every step is visible (and easy to instrument): the
same gather and GQA grouping as ``torch_sdpa`` (:mod:`strategies.attention.gather`), then
``softmax(q @ k^T * scale + mask) @ v`` with the softmax in float32 whatever the model dtype
(as Hugging Face's eager attention does). The query heads that share a KV head are stacked as
extra rows of one matmul against that head, so K/V are never copied per query head.
"""
from __future__ import annotations

import torch

from engine.attention_metadata import AttentionMetadata
from engine.interfaces.attention import write_kv
from strategies.attention.gather import group_step, ungroup_output


class EagerBackend:
    """Gather + explicit matmul / masked softmax (float32) / matmul."""

    name = "eager"
    attention_pairs = "padded"  # dense matmuls over the padded batch, masked softmax

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of ``query [T, Hq, D]`` over each sequence's context -> ``[T, Hq, D]``."""
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        batch = group_step(query, k_cache, v_cache, metadata)
        scores = torch.matmul(batch.query, batch.key.transpose(-1, -2)).float() * scale
        scores.masked_fill_(~batch.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(batch.value.dtype)
        out = torch.matmul(probs, batch.value)
        return ungroup_output(out, batch, query.shape[1])
