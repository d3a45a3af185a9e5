"""``torch_sdpa``: gather the paged context, then PyTorch's ``scaled_dot_product_attention``.

Per layer: write the new K/V into the cache, copy every sequence's context out through its
block table into a padded dense batch (:mod:`strategies.attention.gather`), run one masked SDPA
call over it, and unpad. SDPA dispatches to the best dense kernel it has (flash / memory
efficient / math), but the gather copy and the padding of ragged batches stay: this is the
"paged storage, dense compute" baseline that a fused paged kernel (``triton_paged``, vLLM's
``paged_attention``) improves on by reading the blocks in place.

GQA is done by grouping (queries reshaped onto their shared KV head, see ``gather.py``), not
with ``enable_gqa=True``: profiled on torch 2.13, the CPU flash kernel handles ``enable_gqa``
without a copy but the math kernel ``repeat_interleave``-s K and V up to ``num_heads``, and
which kernel SDPA picks depends on device, dtype and mask. Grouping never copies on any kernel.

Per step, not per layer: the gather's slot indices and the mask (passed to SDPA already as the
``0 / -inf`` float tensor SDPA would otherwise rebuild from a bool mask on every call) come
from the step's cached :class:`~strategies.attention.gather.StepLayout`. A decode-specialised
matmul / softmax / matmul path instead of SDPA was measured and rejected: on an uncontended
CPU the flash kernel was faster at B = 1 / 8 / 32 and contexts 128 / 1024 (docs/performance.md,
section 4).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata
from engine.interfaces.attention import write_kv
from strategies.attention.gather import group_step, ungroup_output


class TorchSDPABackend:
    """Gather + masked ``F.scaled_dot_product_attention``; decode-only steps skip all padding."""

    name = "torch_sdpa"
    attention_pairs = "padded"  # one dense masked SDPA call over the padded batch

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
        out = F.scaled_dot_product_attention(
            batch.query, batch.key, batch.value, attn_mask=batch.layout.additive_mask(batch.query.dtype), scale=scale
        )
        return ungroup_output(out, batch, query.shape[1])
