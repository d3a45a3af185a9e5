"""``cpu_paged``: a C kernel that reads the paged KV cache *in place* on the CPU (no gather).

The gather backends (``torch_sdpa``, ``eager``) copy every sequence's whole context out of the
block-table pages into a padded dense tensor in every layer, then run dense attention on it —
on a 2-core CPU that copy plus the padded SDPA call was ~30% of a decode step at batch 32
(docs/performance.md, section 3.4). This backend is the CPU counterpart of ``triton_paged`` and of vLLM's CPU
``paged_attention``: like a process reading memory through its page table, the kernel resolves
each key position ``t`` to ``block_tables[seq, t // block_size]`` and reads that page's K/V rows
where they lie. Memory traffic per layer is one read of the context, nothing is written but the
output, and ragged batches need no padding (each sequence attends over its own length).

Work split (``csrc/paged_attention.c``): one item per (sequence, chunk of query tokens) with
all its heads, so each K/V slot (all KV heads side by side) is read once and serves the ``G``
query heads of each KV head; scores of a tile of 16 keys (8 with AVX2) come out as one vector
(lane sums, no per-key horizontal sum), one online-softmax update per chunk of 256 keys, values
accumulated in a register tile. Decode, prefill, chunked prefill and prefix-cached prefill are
one causal code path.

Float32 on CPU only (the kernel's arithmetic is float32, like SDPA's CPU kernel for float32);
the kernel is compiled with the machine's C compiler on first use (``engine/native.py``). The
new tokens' K/V are written into their slots by the same call (vLLM's ``reshape_and_cache``). Results
differ from SDPA only by float32 summation order (~1e-7 relative).

The cache may also hold bfloat16 (``kv_cache_dtype=bfloat16``, vLLM's ``kv_cache_dtype``): the
same kernel, compiled a second time for 2-byte elements, reads half the bytes per step (in a decode
step of many sequences, reading the context is most of attention's time) and widens each K/V
vector to float32 on load; the new K/V are rounded to bfloat16 as they are written. Attention over
that cache equals this kernel's float32 result over the bf16-rounded K/V. Over such a cache, long
prompt chunks may attend in bfloat16 through torch's flash-attention kernel instead
(``prefill_attention_dtype``, :mod:`strategies.attention.bf16_prompt_attention`): the step is split
once, the C kernel keeps the other sequences.

A mixed step's decode rows and prompt chunks need no padding here, so the backend attends them in
one call (``mixed_steps_in_one_call``) and such steps may run whole layers in C.
"""
from __future__ import annotations

import ctypes

import torch

from engine import native
from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.native_layers import NativeAttention
from strategies.attention import bf16_prompt_attention
from strategies.attention.bf16_prompt_attention import PromptSplit

_MAX_HEAD_DIM = 256  # csrc/paged_attention.c: MAX_HEAD_DIM
_MAX_HEADS = 64  # csrc/paged_attention.c: MAX_VECTORS (query vectors of one work item)


def _kernel(name: str):
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    return native.function("paged_attention", name, [
        pointer, i64, pointer, pointer, i64,  # query, its token stride, new keys, new values, their token stride
        pointer, i64, pointer, pointer,  # slot_mapping, num_tokens, k_cache, v_cache
        pointer, i64, pointer, pointer,  # block_tables, its row stride, context_lens, query_start_loc
        i64, i64, i64, i64, i64,  # num_seqs, num_heads, num_kv_heads, head_dim, block_size
        ctypes.c_float, pointer, i64, pointer,  # scale, out, out token stride, per-step context (unused: NULL)
    ], ctypes.c_int)


def _token_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor [T, heads, head_dim]`` with each token's heads contiguous (copied only if not)."""
    if tensor.stride(2) != 1 or tensor.stride(1) != tensor.shape[2]:
        return tensor.contiguous()
    return tensor


def _kernel_ints(metadata: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """The step's index tensors in the dtypes the C signature reads (int64 slots, int32 rest: the
    metadata's documented dtypes, so these are no-op conversions), once per step for all layers."""
    return (
        metadata.slot_mapping.to(torch.int64).contiguous(),
        metadata.block_tables.to(torch.int32).contiguous(),
        metadata.context_lens.to(torch.int32).contiguous(),
        metadata.query_start_loc.to(torch.int32).contiguous(),
    )


#: the kernel's entry point per cache dtype (the backend holds each as the attribute ``_<name>``)
KERNEL_NAMES = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16kv"}


class CpuPagedBackend:
    """Fused paged attention for CPU float32 (C kernel, OpenMP over sequences x KV heads), over a
    float32 or bfloat16 KV cache."""

    name = "cpu_paged"
    attention_pairs = "causal"  # each query row reads its own context only
    kv_cache_dtypes = tuple(KERNEL_NAMES)  # the cache dtypes its kernels read
    mixed_steps_in_one_call = True  # decode rows and prompt chunks of one step in one call, unpadded (engine.model)
    bf16_prompts: PromptSplit | None = None  # prompt chunks that attend in bfloat16 over a bfloat16 cache (None: none)

    def __init__(self) -> None:
        for name in KERNEL_NAMES.values():  # built now: a missing compiler fails at startup
            setattr(self, f"_{name}", _kernel(name))

    def kernel(self, kv_cache_dtype: torch.dtype):
        """The C function over a ``kv_cache_dtype`` cache (one of :attr:`kv_cache_dtypes`, checked by the callers)."""
        return getattr(self, f"_{KERNEL_NAMES[kv_cache_dtype]}")

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
        """Write the new K/V, then attention of ``query [T, Hq, D]`` over each sequence's context (each
        query row up to its causal end) -> ``[T, Hq, D]``."""
        query, key, value = self.checked_inputs(query, key, value, k_cache, v_cache)
        num_tokens, num_heads, head_dim = query.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype)
        prompt_plan = self.prompt_plan(metadata) if k_cache.dtype == torch.bfloat16 else None
        if prompt_plan is None or not prompt_plan.chunks:
            self._run_kernel(query, key, value, k_cache, v_cache, metadata, scale, out, (0, metadata.num_seqs), num_tokens)
            return out
        for index, seqs in enumerate(prompt_plan.kernel_runs or ((0, 0),)):  # the first call writes every new K/V
            self._run_kernel(query, key, value, k_cache, v_cache, metadata, scale, out, seqs, num_tokens if index == 0 else 0)
        for chunk in prompt_plan.chunks:
            bf16_prompt_attention.attend(query, k_cache, v_cache, chunk, scale, out)
        return out

    def attends_natively(self, metadata: AttentionMetadata) -> bool:
        """Whether the C kernel attends every sequence of the step (no prompt chunk goes to bfloat16
        flash attention), so callers that run whole layers in C may take it."""
        prompt_plan = self.prompt_plan(metadata)
        return prompt_plan is None or not prompt_plan.chunks

    def prompt_plan(self, metadata: AttentionMetadata) -> bf16_prompt_attention.PromptPlan | None:
        """The step's split between the C kernel and flash attention (built once per step), or
        ``None`` where there is none: no bfloat16 prompt attention, or no sequence with enough rows."""
        split = self.bf16_prompts
        if split is None or metadata.max_query_len < split.min_rows:
            return None
        return metadata.cached(("cpu_paged.bf16_prompts", split), lambda: bf16_prompt_attention.plan(metadata, split))

    def use_bf16_prompt_attention(self, split: PromptSplit = PromptSplit()) -> None:
        """Attend the prompt chunks that ``split`` takes over a bfloat16 cache in bfloat16, through
        torch's flash-attention kernel (:mod:`strategies.attention.bf16_prompt_attention`); the C
        kernel keeps the other sequences and every float32 cache. Set by ``prefill_attention_dtype``."""
        self.bf16_prompts = split

    def _run_kernel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, out: torch.Tensor,
                    seqs: tuple[int, int], write_tokens: int) -> None:
        """The C kernel: write the first ``write_tokens`` new K/V rows, then attend sequences ``seqs``
        (a ``[first, last)`` range) into ``out``."""
        num_heads, head_dim = query.shape[1:]
        slot_mapping, block_tables, context_lens, query_start_loc = metadata.cached(
            "cpu_paged.ints", lambda: _kernel_ints(metadata)
        )
        first, last = seqs
        status = self.kernel(k_cache.dtype)(
            query.data_ptr(), query.stride(0), key.data_ptr(), value.data_ptr(), key.stride(0),
            slot_mapping.data_ptr(), write_tokens, k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables[first:].data_ptr(), block_tables.stride(0), context_lens[first:].data_ptr(),
            query_start_loc[first:].data_ptr(), last - first, num_heads, k_cache.shape[2], head_dim,
            metadata.block_size, scale, out.data_ptr(), out.stride(0), None,
        )
        if status != 0:
            raise RuntimeError(f"{self.name} kernel failed with status {status}")

    def native_attention(self, metadata: AttentionMetadata, model_config: ModelConfig,
                         kv_cache_dtype: torch.dtype) -> NativeAttention:
        """The kernel for a ``kv_cache_dtype`` cache and this step's index tensors for callers that
        run whole layers in C (:mod:`engine.native_layers`): the same call as :meth:`forward` makes."""
        self.require_kv_cache_dtype(kv_cache_dtype)
        kernel = self.kernel(kv_cache_dtype)
        ints = metadata.cached("cpu_paged.ints", lambda: _kernel_ints(metadata))
        return NativeAttention(ctypes.cast(kernel, ctypes.c_void_p).value, *ints)

    def require_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``ValueError`` unless this backend's kernels read a ``dtype`` cache."""
        if dtype not in self.kv_cache_dtypes:
            readable = ", ".join(str(d).removeprefix("torch.") for d in self.kv_cache_dtypes)
            raise ValueError(f"attention={self.name} reads a KV cache of {readable}; the cache is {dtype}")

    def checked_inputs(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``query``, ``key``, ``value`` as the C kernels read them (each token's heads contiguous, K and V
        rows the same stride apart), after checking dtype, device, sizes and the caches' layout."""
        hint = " (use torch_sdpa, or triton_paged on CUDA)"
        native.require_cpu_float32(query, f"attention={self.name}", "the query", hint)
        if k_cache.device.type != "cpu" or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"attention={self.name} needs both KV caches on the CPU in one dtype; got {k_cache.dtype} "
                             f"on {k_cache.device} and {v_cache.dtype}{hint}")
        self.require_kv_cache_dtype(k_cache.dtype)
        num_heads, head_dim = query.shape[1:]
        if head_dim > _MAX_HEAD_DIM or num_heads > _MAX_HEADS:
            raise ValueError(
                f"{self.name} supports head_dim <= {_MAX_HEAD_DIM} and num_heads <= {_MAX_HEADS}; "
                f"got head_dim {head_dim}, num_heads {num_heads}"
            )
        # q/k/v usually arrive as strided views of the fused qkv output: no copy needed.
        query, key, value = _token_rows(query), _token_rows(key), _token_rows(value)
        if key.stride(0) != value.stride(0):
            key, value = key.contiguous(), value.contiguous()
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError(f"{self.name}: the KV caches must be contiguous tensors")
        return query, key, value
