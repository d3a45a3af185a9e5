"""Whole decoder layers in one C call each, for decode-sized steps (``engine/csrc/decoder_layer.c``).

With the projections in the skinny GEMM and the elementwise work in the fused kernels, what is
left of a batch-1 decode step besides the weight stream is Python: per layer ~15 operations
(module calls, the kernels' wrappers, ctypes argument conversion, a tensor allocation per
output), ~70 us a layer, ~2 ms of SmolLM2-135M's ~17 ms step on one core, and on two threads a
part that only one core runs (docs/performance.md, section 3.1). :class:`NativeLayers` runs the
same kernels in the same order from C instead: one ctypes call per layer, one allocation of
scratch buffers per step for all layers, so the arithmetic is the Python path's exactly
(``tests/test_optimizations.py`` checks bit-equal logits).

The C side calls every kernel through a function pointer looked up here in that kernel's own
library, with all metadata explicit:

* **linears** through :meth:`engine.weight_copies.Linear.native_kernels`, the one method a linear with its
  own C kernels provides (function, weight, bias, most rows): the skinny GEMM, and before it the
  quantized GEMM over a GGUF checkpoint's blocks for fewer rows. Like ``Linear.forward``, a step
  of ``T`` rows gives each linear its first kernel that serves ``T`` rows;
* **attention** through the backend's optional ``native_attention(metadata, model_config, kv_cache_dtype)``
  (see :class:`NativeAttention`): its kernel, the step's index tensors and, for a backend that
  plans per step (the cascade backend's groups), that plan as an opaque context every layer's
  call passes through; backends without it (the gather backends) keep the Python layer path.

A step takes this path when it is a single attention call (no per-run ``attention_parts``) and
has at most :attr:`NativeLayers.max_rows` rows (every linear's C kernel serves that many: 128
with AVX-512): decode steps and small mixed steps. Prompts take the Python path (oneDNN).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine import native
from engine.attention_metadata import AttentionMetadata
from engine.fused_ops import FusedOps

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@dataclass(frozen=True)
class NativeLinear:
    """A linear as C sees it: ``function`` (address of a C function with the skinny GEMM's
    signature, ``engine/csrc/decoder_layer.c``: ``linear_fn``), its weight in that function's
    format and bias (addresses; ``None``: no bias), and the most input rows it serves."""

    function: int
    weight: int
    bias: int | None
    max_rows: int


@dataclass(frozen=True)
class NativeAttention:
    """An attention backend's kernel for C callers, for one step: ``function`` has the signature
    of ``paged_attention_f32`` (``engine/csrc/paged_attention.c``: writes the step's K/V,
    then attends), the step's index tensors are in the dtypes it reads (int64 slots, int32 rest),
    and ``context`` is the address of the backend's per-step plan that every layer's call passes
    through (0: none; ``keep_alive`` holds what it points to)."""

    function: int
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    context: int = 0
    keep_alive: object = None


class _Linear(ctypes.Structure):
    _fields_ = [("run", _P), ("weight", _P), ("bias", _P)]


class _LayerWeights(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", _P), ("post_attention_norm", _P)]


class _LayerStep(ctypes.Structure):
    _fields_ = [
        ("add_rms_norm", _P), ("rope", _P), ("silu_and_mul", _P), ("attention", _P),
        ("num_tokens", _I64), ("hidden_size", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
        ("head_dim", _I64), ("intermediate_size", _I64), ("eps", _F32), ("scale", _F32),
        ("positions", _P), ("cos_sin", _P), ("slot_mapping", _P), ("block_tables", _P),
        ("block_table_stride", _I64), ("context_lens", _P), ("query_start_loc", _P),
        ("num_seqs", _I64), ("block_size", _I64),
        ("normed", _P), ("qkv", _P), ("attention_out", _P), ("gate_up", _P), ("activation", _P),
        ("attention_context", _P),
    ]


def _linear(kernel: NativeLinear) -> _Linear:
    return _Linear(kernel.function, kernel.weight, kernel.bias)


class NativeLayers:
    """The decoder layers of one model as C calls (built by :meth:`engine.model.CausalLM.use_native_layers`).

    Raises ``ValueError`` if a layer has a linear without a C kernel (see :meth:`available`); the
    C library is compiled on construction (``engine/native.py``).
    """

    @staticmethod
    def layer_linears(layer: torch.nn.Module) -> list:
        """A decoder layer's linears in the order C calls them: qkv, o, gate/up, down."""
        return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]

    @classmethod
    def available(cls, model: torch.nn.Module) -> bool:
        """Whether every linear of every layer has a C kernel (a model with some linears only in
        Python, e.g. a weight format without one, keeps the Python layers)."""
        return all(linear.native_kernels() for layer in model.layers for linear in cls.layer_linears(layer))

    def __init__(self, model: torch.nn.Module, fused_ops: FusedOps) -> None:
        config = model.config
        self.config = config
        self._run_layer = native.function("decoder_layer", "decoder_layer_f32", [_P, _P, _P, _P, _P, _P, ctypes.c_int], ctypes.c_int)
        self._kernels = fused_ops.addresses()
        kernels = [[linear.native_kernels() for linear in self.layer_linears(layer)] for layer in model.layers]
        if not all(per_linear for per_layer in kernels for per_linear in per_layer):
            raise ValueError("a linear has no C kernel (prepack with the skinny GEMM first)")
        self.max_rows = min(per_linear[-1].max_rows for per_layer in kernels for per_linear in per_layer)
        # One set of layer weights per row limit at which some linear switches kernels (e.g. the
        # quantized GEMM up to 14 rows, the skinny GEMM above): a step uses the first set that serves it.
        limits = sorted({kernel.max_rows for per_layer in kernels for per_linear in per_layer for kernel in per_linear
                         if kernel.max_rows <= self.max_rows})
        self._weights_by_limit = [
            (limit, [
                _LayerWeights(
                    *(_linear(next(kernel for kernel in per_linear if kernel.max_rows >= limit)) for per_linear in per_layer),
                    layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                )
                for layer, per_layer in zip(model.layers, kernels)
            ])
            for limit in limits
        ]
        self._eps = model.norm.eps
        self._cos_sin = model.rotary.cos_sin

    def can_run(self, num_tokens: int, attention, metadata: AttentionMetadata) -> bool:
        """Whether a step of ``num_tokens`` rows described by ``metadata`` can take this path with this
        attention backend: it offers its kernel (``native_attention``) and, where it has
        ``attends_natively``, that kernel is the one it would use for every sequence of the step."""
        if num_tokens > self.max_rows or getattr(attention, "native_attention", None) is None:
            return False
        attends_natively = getattr(attention, "attends_natively", None)
        return attends_natively is None or attends_natively(metadata)

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata, attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers on the embeddings ``hidden [T, hidden_size]`` -> ``(last MLP output, residual
        stream before it)``, as the Python layers return them; the step's K/V are written into
        ``kv_caches`` on the way."""
        c = self.config
        kernel: NativeAttention = attention.native_attention(metadata, c, kv_caches[0][0].dtype)
        num_tokens = hidden.shape[0]
        qkv_size = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        # The step's scratch, shared by all layers: normed, qkv, attention out, gate_up, activation.
        sizes = [c.hidden_size, qkv_size, c.q_size, 2 * c.intermediate_size, c.intermediate_size]
        buffers = [torch.empty(num_tokens, size) for size in sizes]
        positions = positions.to(torch.int64).contiguous()
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        step = _LayerStep(
            *self._kernels, kernel.function,
            num_tokens, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, self._eps, c.head_dim**-0.5,
            positions.data_ptr(), self._cos_sin.data_ptr(), kernel.slot_mapping.data_ptr(),
            kernel.block_tables.data_ptr(), kernel.block_tables.stride(0), kernel.context_lens.data_ptr(),
            kernel.query_start_loc.data_ptr(), metadata.num_seqs, metadata.block_size,
            *(buffer.data_ptr() for buffer in buffers), kernel.context,
        )
        step_pointer, hidden_pointer, residual_pointer = ctypes.byref(step), hidden.data_ptr(), residual.data_ptr()
        layer_weights = next(weights for limit, weights in self._weights_by_limit if num_tokens <= limit)
        for index, (weights, (k_cache, v_cache)) in enumerate(zip(layer_weights, kv_caches)):
            if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                raise ValueError("native layers: the KV caches must be contiguous tensors")
            status = self._run_layer(ctypes.byref(weights), step_pointer, k_cache.data_ptr(), v_cache.data_ptr(),
                                     hidden_pointer, residual_pointer, index == 0)
            if status != 0:
                raise RuntimeError(f"decoder layer {index}: the attention kernel failed with status {status}")
        return hidden, residual
