"""``cpu_paged_cascade``: shared-prefix (cascade) attention — a shared prompt is read once per step.

With a prefix cache, users who sent the same system prompt hold the *same physical blocks* at
the start of their block tables. A per-sequence kernel (``cpu_paged``) still attends over those
blocks once per user: 30 users x 500 shared tokens = 15,000 key rows per layer, all the same
500. Cascade (two-level) attention, as in FlashInfer's cascade kernels and SGLang's
RadixAttention, splits each query's keys into the shared prefix and its own suffix:

1. **own part, per sequence**: its keys from the prefix end on (a few dozen in decode), read in
   place through its block table, with each query vector's log-sum-exp kept for the merge; a
   tile of 16 (8) keys is scored as 16 vectors of per-dim partial products and lane-summed into
   one vector of scores, so short rows cost little per row (sequences outside every group take
   the same path over their whole context);
2. **shared part, once per group, merged in place** (``csrc/cascade_attention.c``): the queries
   of all members x query heads of one KV head fill the lanes of a vector (16 with AVX-512, 8
   with AVX2) and attend to the prefix keys together, as two register-tiled matrix products
   (scores, then values) instead of one thin dot product per user and key — on a CPU the same
   multiply-adds, but without horizontal sums and with one load per lane count of them. The
   prefix is first copied out of the paged cache (K transposed into key tiles, V rows side by
   side) in every layer of every step: that streaming read also brings it into cache for the
   products (a copy kept across steps was measured slower). Both parts are softmax-normalised over
   their own keys; with their log-sum-exps ``s1``, ``s2`` the exact result is
   ``(o1 e^{s1} + o2 e^{s2}) / (e^{s1} + e^{s2})``, which the kernel writes over the own part.

So a decode step with groups costs one C call per layer (it also writes the step's new K/V) and no
tensor op in Python. The grouping is built once per step
(:func:`plan_groups`, cached on the attention metadata for all layers) from the step's block
tables, no engine help needed: decode sequences whose first block is the same physical block
share a prefix; the shared length is the run of equal leading blocks common to all members,
counting only *full* blocks strictly before every member's query token (those are never written
this step). Equal block ids mean identical K/V by construction, so the result equals
``cpu_paged``'s up to float32 summation order. Steps with prefill rows, and groups below
``min_group_size`` members or ``min_shared_tokens`` tokens, take the plain ``cpu_paged`` path.
``stats`` counts what ran (tests assert the cascade path really ran).
"""
from __future__ import annotations

import ctypes
from collections import defaultdict
from dataclasses import dataclass

import torch

from engine import native
from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.native_layers import NativeAttention
from strategies.attention.cpu_paged import CpuPagedBackend, _kernel_ints


_POINTER, _I64 = ctypes.c_void_p, ctypes.c_int64


def _kernel():
    return native.function("cascade_attention", "cascade_decode_f32", [
        _POINTER, _I64, _POINTER, _POINTER, _I64,  # query, its token stride, new keys, new values, their token stride
        _POINTER, _I64, _POINTER, _POINTER,  # slot_mapping, num_tokens, k_cache, v_cache
        _POINTER, _I64, _POINTER, _POINTER,  # block_tables, its row stride, context_lens, kv_starts
        _I64, _POINTER, _POINTER, _POINTER, _POINTER,  # num_groups, row_starts, rows, block_starts, blocks
        _I64, _I64, _I64, _I64,  # num_heads, num_kv_heads, head_dim, block_size
        ctypes.c_float, _POINTER, _I64, _POINTER,  # scale, out, its token stride, lse scratch
        _POINTER, _I64,  # workspace, its size in floats
    ], ctypes.c_int)


class _PlanStruct(ctypes.Structure):
    """``struct cascade_plan`` of ``engine/csrc/cascade_attention.c``: one step's groups and scratch
    for ``cascade_decode_layer_f32`` (whole decoder layers in C)."""

    _fields_ = [("kv_starts", _POINTER), ("num_groups", _I64), ("row_starts", _POINTER), ("rows", _POINTER),
                ("block_starts", _POINTER), ("blocks", _POINTER), ("lse", _POINTER), ("workspace", _POINTER),
                ("workspace_floats", _I64)]


def _layer_kernel_address() -> int:
    """``cascade_decode_layer_f32``: the cascade kernel with the attention signature of
    ``engine/csrc/decoder_layer.c``, its plan passed as the per-step context."""
    return ctypes.cast(native.function("cascade_attention", "cascade_decode_layer_f32", [], ctypes.c_int),
                       ctypes.c_void_p).value


def _workspace_size():
    # num_groups, block_starts, num_kv_heads, head_dim, block_size -> floats
    return native.function("cascade_attention", "cascade_workspace_floats", [_I64, _POINTER, _I64, _I64, _I64], _I64)


@dataclass(frozen=True)
class PrefixGroup:
    """Decode rows (= sequence and token indices) holding the physical blocks ``blocks`` as their first blocks."""

    rows: list[int]
    blocks: tuple[int, ...]
    num_tokens: int

    @property
    def num_rows(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class CascadePlan:
    """One step's groups, flattened into the index arrays the C kernel reads, and every sequence's
    first own key (0 outside groups)."""

    groups: list[PrefixGroup]
    kv_starts: torch.Tensor  # int32 [B]
    row_starts: torch.Tensor  # int64 [groups + 1]: group g's rows are rows[row_starts[g]:row_starts[g + 1]]
    rows: torch.Tensor  # int32
    block_starts: torch.Tensor  # int64 [groups + 1], likewise into blocks
    blocks: torch.Tensor  # int32


@dataclass
class CascadeStats:
    """Cumulative counts: forward calls that took the cascade path, groups, and shared key rows
    that were read once per group instead of once per member (summed over layers)."""

    cascade_calls: int = 0
    groups: int = 0
    shared_rows_saved: int = 0


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


def plan_groups(metadata: AttentionMetadata, min_group_size: int, min_shared_tokens: int) -> CascadePlan:
    """Find the decode step's shared-prefix groups from its block tables."""
    block_size = metadata.block_size
    tables = metadata.block_tables.tolist()
    # full blocks strictly before the query token (position context_len - 1)
    usable = ((metadata.context_lens.to(torch.int64) - 1) // block_size).tolist()
    by_first_block: dict[int, list[int]] = defaultdict(list)
    for row, count in enumerate(usable):
        if count > 0:
            by_first_block[tables[row][0]].append(row)
    kv_starts = [0] * len(usable)
    groups = []
    for rows in by_first_block.values():
        if len(rows) < min_group_size:
            continue
        leader, limit = tables[rows[0]], min(usable[row] for row in rows)
        common = 0
        while common < limit and all(tables[row][common] == leader[common] for row in rows):
            common += 1
        if common * block_size < min_shared_tokens:
            continue
        for row in rows:
            kv_starts[row] = common * block_size
        groups.append(PrefixGroup(rows, tuple(leader[:common]), common * block_size))
    return CascadePlan(
        groups, torch.tensor(kv_starts, dtype=torch.int32),
        _offsets([g.num_rows for g in groups]), torch.tensor([r for g in groups for r in g.rows], dtype=torch.int32),
        _offsets([len(g.blocks) for g in groups]), torch.tensor([b for g in groups for b in g.blocks], dtype=torch.int32),
    )


class CpuPagedCascadeBackend(CpuPagedBackend):
    """``cpu_paged`` plus cascade attention over prefixes shared by decode sequences (CPU float32).

    Args:
        min_group_size: fewest sequences sharing a prefix for the cascade path (at least 2).
        min_shared_tokens: shortest shared prefix (whole blocks) worth a separate pass.
    """

    name = "cpu_paged_cascade"
    kv_cache_dtypes = (torch.float32,)  # the cascade kernel reads float32 caches only
    mixed_steps_in_one_call = False  # a mixed step's decode run needs its own call to take the cascade

    def __init__(self, min_group_size: int = 2, min_shared_tokens: int = 64) -> None:
        if min_group_size < 2:
            raise ValueError(f"min_group_size must be >= 2 (a group of one shares nothing), got {min_group_size}")
        if min_shared_tokens < 1:
            raise ValueError(f"min_shared_tokens must be >= 1, got {min_shared_tokens}")
        super().__init__()
        self._cascade = _kernel()  # builds it now: a missing compiler fails at startup
        self._cascade_layer = _layer_kernel_address()  # looked up once, not in every step
        self._workspace_size = _workspace_size()
        self._workspace = torch.empty(0)  # the kernel's packed prefixes; grows to the largest step seen
        self.min_group_size = min_group_size
        self.min_shared_tokens = min_shared_tokens
        self.stats = CascadeStats()

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
        plan = self.step_plan(metadata)
        if plan is None:
            return super().forward(query, key, value, k_cache, v_cache, metadata, scale)
        query, key, value = self.checked_inputs(query, key, value, k_cache, v_cache)
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        slot_mapping, block_tables, context_lens, _ = metadata.cached("cpu_paged.ints", lambda: _kernel_ints(metadata))
        self.reserve_workspace(metadata, plan, num_kv_heads, head_dim)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32)
        status = self._cascade(
            query.data_ptr(), query.stride(0), key.data_ptr(), value.data_ptr(), key.stride(0),
            slot_mapping.data_ptr(), num_tokens, k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), plan.kv_starts.data_ptr(),
            len(plan.groups), plan.row_starts.data_ptr(), plan.rows.data_ptr(),
            plan.block_starts.data_ptr(), plan.blocks.data_ptr(),
            num_heads, num_kv_heads, head_dim, metadata.block_size, scale, out.data_ptr(), out.stride(0),
            lse.data_ptr(), self._workspace.data_ptr(), self._workspace.numel(),
        )
        if status != 0:
            raise RuntimeError(f"{self.name} kernel failed with status {status}")
        self.count(plan, calls=1)
        return out

    def step_plan(self, metadata: AttentionMetadata) -> CascadePlan | None:
        """This step's groups (computed once per step for all layers), or ``None`` where the step
        takes ``cpu_paged``'s path: not decode-only, too few sequences, or no shared prefix."""
        if not metadata.is_decode_only or metadata.num_seqs < self.min_group_size:
            return None
        plan = metadata.cached(
            ("cpu_paged_cascade.plan", self.min_group_size, self.min_shared_tokens),
            lambda: plan_groups(metadata, self.min_group_size, self.min_shared_tokens),
        )
        return plan if plan.groups else None

    def reserve_workspace(self, metadata: AttentionMetadata, plan: CascadePlan, num_kv_heads: int, head_dim: int) -> None:
        """Grow the packed-prefix workspace to what ``plan``'s groups need (kept across steps)."""
        needed = metadata.cached(
            ("cpu_paged_cascade.workspace", self.min_group_size, self.min_shared_tokens, num_kv_heads, head_dim),
            lambda: self._workspace_size(len(plan.groups), plan.block_starts.data_ptr(), num_kv_heads, head_dim,
                                         metadata.block_size),
        )
        if self._workspace.numel() < needed:
            self._workspace = torch.empty(needed)

    def count(self, plan: CascadePlan, calls: int) -> None:
        """Record ``calls`` kernel calls (one per layer) over ``plan``'s groups in :attr:`stats`."""
        self.stats.cascade_calls += calls
        self.stats.groups += calls * len(plan.groups)
        self.stats.shared_rows_saved += calls * sum((g.num_rows - 1) * g.num_tokens for g in plan.groups)

    def native_attention(self, metadata: AttentionMetadata, model_config: ModelConfig,
                         kv_cache_dtype: torch.dtype) -> NativeAttention:
        """For whole decoder layers in C (:mod:`engine.native_layers`): ``cpu_paged``'s kernel where
        the step takes its path, else the cascade kernel with this step's plan as the context that
        every layer's call passes through (the same call :meth:`forward` makes, layer by layer)."""
        plan = self.step_plan(metadata)
        if plan is None:
            return super().native_attention(metadata, model_config, kv_cache_dtype)
        num_kv_heads, head_dim = model_config.num_key_value_heads, model_config.head_dim
        self.reserve_workspace(metadata, plan, num_kv_heads, head_dim)
        slot_mapping, block_tables, context_lens, query_start_loc = metadata.cached(
            "cpu_paged.ints", lambda: _kernel_ints(metadata))
        lse = torch.empty(metadata.num_seqs, model_config.num_attention_heads, dtype=torch.float32)  # decode: a token per sequence
        context = _PlanStruct(
            plan.kv_starts.data_ptr(), len(plan.groups), plan.row_starts.data_ptr(), plan.rows.data_ptr(),
            plan.block_starts.data_ptr(), plan.blocks.data_ptr(), lse.data_ptr(), self._workspace.data_ptr(),
            self._workspace.numel(),
        )
        self.count(plan, calls=model_config.num_hidden_layers)
        return NativeAttention(self._cascade_layer, slot_mapping, block_tables, context_lens, query_start_loc,
                               ctypes.addressof(context), (context, lse, plan, self._workspace))
