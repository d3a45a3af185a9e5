"""Fused CPU kernels for the decoder's elementwise work (``engine/csrc/fused_ops.c``).

A decode step at batch 32 is ~120 matmuls plus ~25 small elementwise ops per layer: RMSNorm
alone is seven ATen kernels in eager mode, RoPE four, SiLU-and-multiply two, each a dispatch and
a pass over the activations. vLLM fuses them (``fused_add_rms_norm``, ``silu_and_mul``,
``rotary_embedding``); these are the same three as C loops, one parallel pass over the tokens
each. :class:`FusedOps` is what the model calls when ``engine.fused_ops`` is on (CPU float32);
the eager PyTorch forms in ``engine.model`` stay the reference, and ``tests/test_optimizations``
checks the two agree (logits within 1e-5, identical greedy tokens).

Every wrapper takes and returns ordinary tensors, checks what the C code assumes (float32,
CPU, the layout it indexes) and raises ``ValueError`` naming it otherwise.
"""
from __future__ import annotations

import ctypes

import torch

from engine import native

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _check(tensor: torch.Tensor, label: str) -> None:
    native.require_cpu_float32(tensor, "fused ops", label)


class FusedOps:
    """The compiled kernels (built on construction: a missing compiler fails at engine start)."""

    def __init__(self) -> None:
        self._add_rms_norm = native.function("fused_ops", "add_rms_norm_f32", [_P, _P, _P, _F32, _I64, _I64, _INT, _P])
        self._silu_and_mul = native.function("fused_ops", "silu_and_mul_f32", [_P, _I64, _I64, _P])
        self._rope = native.function("fused_ops", "rope_f32", [_P, _I64, _I64, _I64, _I64, _P, _P])

    def addresses(self) -> tuple[int, int, int]:
        """The C functions ``add_rms_norm_f32``, ``rope_f32`` and ``silu_and_mul_f32`` (addresses), for
        callers that run them from C (:mod:`engine.native_layers`)."""
        return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (self._add_rms_norm, self._rope, self._silu_and_mul))

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = x + residual`` (or ``x`` itself when ``residual`` is None), then
        ``(rms_norm(residual) * weight, residual)``. ``x`` is never modified; a given
        ``residual`` is updated in place."""
        _check(x, "x")
        x = x.contiguous()
        if residual is None:
            residual, add = x, 0
        else:
            _check(residual, "residual")
            if not residual.is_contiguous():
                raise ValueError("add_rms_norm: residual must be contiguous (it is updated in place)")
            add = 1
        out = torch.empty_like(x)
        num_tokens, hidden_size = x.shape
        self._add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, num_tokens, hidden_size, add, out.data_ptr())
        return out, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = cat(gate, up)`` along the last dim: ``[T, 2I] -> [T, I]``."""
        _check(gate_up, "gate_up")
        gate_up = gate_up.contiguous()
        num_tokens, double = gate_up.shape
        out = gate_up.new_empty(num_tokens, double // 2)
        self._silu_and_mul(gate_up.data_ptr(), num_tokens, double // 2, out.data_ptr())
        return out

    def rope_(self, qkv: torch.Tensor, num_heads: int, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """RoPE (HF ``rotate_half`` form) in place on the first ``num_heads`` heads of every token
        of ``qkv [T, heads, head_dim]``, with ``cos_sin [max_positions, 2, head_dim]`` float32."""
        _check(qkv, "qkv")
        _check(cos_sin, "cos_sin")
        num_tokens, _, head_dim = qkv.shape
        if qkv.stride(2) != 1 or qkv.stride(1) != head_dim or not cos_sin.is_contiguous():
            raise ValueError("rope_: each token's heads must be contiguous and cos_sin contiguous")
        positions = positions.to(torch.int64).contiguous()
        self._rope(qkv.data_ptr(), qkv.stride(0), num_tokens, num_heads, head_dim, positions.data_ptr(), cos_sin.data_ptr())
