"""``triton_paged``: a Triton kernel that reads the paged KV cache *in place* (no gather).

The gather backends (``torch_sdpa``, ``eager``) first copy each sequence's context out of the
cache into a padded dense tensor, then attend. This kernel never builds that copy: for every
tile of keys it looks up, per key position ``t``, the physical block
``block_tables[seq, t // block_size]`` and loads K/V straight from
``cache[block, t % block_size, kv_head, :]``. It is the idea behind vLLM's ``paged_attention``
(and its Triton "unified attention"): memory traffic is one read of the context per layer,
with no extra write of a gathered copy and no padding to ``max_context_len``.

Work split: one program per (sequence, KV head, tile of query tokens). Its query tile holds
the rows of *all* ``G`` query heads that share the KV head (row ``r`` = query token
``r // G``, head ``kv_head * G + r % G``), so each K/V tile is loaded once for the group (GQA
without copies) and decode steps (one token per sequence) still fill a ``tl.dot`` tile. The
program walks the context in tiles of ``block_n`` keys with an online (flash) softmax:
running max ``m``, running sum ``l``, rescaled accumulator. Tiles need not align with cache
blocks, so any ``block_size`` works (a one-block contiguous cache too). The new tokens' K/V are
written first with the shared :func:`~engine.interfaces.attention.write_kv` (vLLM fuses this
as ``reshape_and_cache``), so prefill, chunked prefill with cached context, and decode are one
code path.

Running it: on CUDA the kernel is compiled natively. On CPU it runs under Triton's
interpreter (numpy, slow: tests only), enabled by ``TRITON_INTERPRET=1`` in the environment
**before triton is first imported in the process**. Triton 3.9 reads the variable lazily
(``triton.knobs.runtime.interpret``) but acts on it when ``@triton.jit`` decorates a function:
interpreted functions become ``InterpretedFunction``, others ``JITFunction``. The language's
own jitted helpers (``tl.zeros``, ``tl.max``, ``tl.sum``, ...) are decorated when
``triton.language`` is imported, so setting the variable later leaves a kernel that fails
with "Cannot call @triton.jit'd outside of the scope of a kernel". Simplest:
``TRITON_INTERPRET=1 python run.py attention=triton_paged device=cpu``.

Triton is an optional extra (``pip install 'servelab[triton]'``): this module imports without
it; constructing the backend then raises an error saying what to install.
"""
from __future__ import annotations

import torch

from engine.attention_metadata import AttentionMetadata
from engine.device import on_device
from engine.interfaces.attention import write_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # optional extra: the backend reports it when constructed
    triton = None

if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
        scale,
        stride_ot, stride_oh, stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_bt,
        HEAD_DIM: tl.constexpr,  # real head_dim
        BLOCK_D: tl.constexpr,  # head_dim padded to a power of two >= 16
        BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
        GROUP: tl.constexpr,  # query heads per KV head
        BLOCK_Q: tl.constexpr,  # query tokens per program
        BLOCK_M: tl.constexpr,  # rows of the query tile: >= BLOCK_Q * GROUP, power of two
        BLOCK_N: tl.constexpr,  # keys per inner-loop tile
        DOT_PRECISION: tl.constexpr,  # "ieee" for exact float32 dots, "tf32" otherwise
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        first_q = tl.program_id(2) * BLOCK_Q
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if first_q >= q_len:  # this sequence has fewer query tokens than the longest one
            return
        ctx_len = tl.load(context_lens_ptr + seq)
        first_pos = ctx_len - q_len  # position of the sequence's first new token

        rows = tl.arange(0, BLOCK_M)
        q_idx = first_q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        q_pos = tl.where(row_ok, first_pos + q_idx, 0)  # unused rows see key 0: finite, not stored
        dims = tl.arange(0, BLOCK_D)
        row_dim_ok = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
        token = (q_start + q_idx).to(tl.int64)
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_dim_ok, other=0.0,
        )

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = tl.minimum(ctx_len, first_pos + first_q + BLOCK_Q)  # last key this tile sees + 1
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(0, kv_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            kv_mask = (pos < kv_end)[:, None] & (dims < HEAD_DIM)[None, :]
            # The in-place read: block table lookup per key, then address the cache directly.
            block = tl.load(table + pos // BLOCK_SIZE, mask=pos < kv_end, other=0).to(tl.int64)
            offset = (pos % BLOCK_SIZE)[:, None]
            k = tl.load(
                k_cache_ptr + block[:, None] * stride_kb + offset * stride_ks
                + kv_head * stride_kh + dims[None, :],
                mask=kv_mask, other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))  # causal (+ ctx end)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_cache_ptr + block[:, None] * stride_vb + offset * stride_vs
                + kv_head * stride_vh + dims[None, :],
                mask=kv_mask, other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / l_i[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_dim_ok,
        )


def triton_interpreted() -> bool:
    """True when this kernel and triton's own jitted helpers run under the CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return all(isinstance(fn, InterpretedFunction) for fn in (_paged_attention_kernel, tl.zeros))


_INTERPRET_HINT = (
    "set TRITON_INTERPRET=1 in the environment before triton is first imported in the process "
    "(e.g. `TRITON_INTERPRET=1 python run.py attention=triton_paged device=cpu`) to run the "
    "kernel under Triton's CPU interpreter (slow, for tests)"
)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonPagedBackend:
    """Fused paged attention in Triton: K/V read in place through the block table.

    Args:
        block_m: query-tile rows per program for steps with prefill (power of two >= 16);
            decode-only steps use the smallest tile (16, or ``next_pow2(G)``). A tile holds
            ``block_m // G`` query tokens of all ``G`` heads sharing a KV head.
        block_n: keys per inner-loop tile (power of two >= 16), independent of the cache's
            block size.

    Supports float32 (exact ``ieee`` dots), float16 and bfloat16 (fp32 accumulation).
    """

    name = "triton_paged"
    attention_pairs = "causal"  # key tiles past a query tile's last position are skipped

    def __init__(self, block_m: int = 64, block_n: int = 32) -> None:
        if triton is None:
            raise ImportError(
                "attention=triton_paged needs Triton: pip install 'servelab[triton]' "
                "(or `pip install triton`)"
            )
        for label, value in (("block_m", block_m), ("block_n", block_n)):
            if not (_is_power_of_two(value) and value >= 16):
                raise ValueError(f"{label} must be a power of two >= 16, got {value}")
        if not triton_interpreted() and not torch.cuda.is_available():
            raise RuntimeError(f"triton_paged: no CUDA device; {_INTERPRET_HINT}")
        self.block_m = block_m
        self.block_n = block_n

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
        if query.device.type != "cuda" and not triton_interpreted():
            raise RuntimeError(f"triton_paged: tensors are on {query.device}; {_INTERPRET_HINT}")
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        query = query.contiguous()
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        rows = 16 if metadata.is_decode_only else self.block_m
        block_m = max(rows, triton.next_power_of_2(group))
        block_q = block_m // group
        out = torch.empty_like(query)
        grid = (metadata.num_seqs, num_kv_heads, triton.cdiv(metadata.max_query_len, block_q))
        with on_device(query.device):  # Triton launches on the current CUDA device
            _paged_attention_kernel[grid](
                out, query, k_cache, v_cache,
                metadata.block_tables, metadata.query_start_loc, metadata.context_lens,
                scale,
                out.stride(0), out.stride(1), query.stride(0), query.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                metadata.block_tables.stride(0),
                HEAD_DIM=head_dim,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_SIZE=metadata.block_size,
                GROUP=group,
                BLOCK_Q=block_q,
                BLOCK_M=block_m,
                BLOCK_N=self.block_n,
                DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            )
        return out
