"""Our Llama-family / Qwen2 decoder, written for a flat varlen token batch.

There is no batch dimension and no padding: one engine step concatenates the new tokens of
every scheduled sequence into ``T`` rows (``input_ids [T]``, ``positions [T]``), whether a row
is a prompt token (prefill) or the one new token of a decoding sequence. Everything that is
per-token — embedding, RMSNorm, the fused ``qkv_proj`` / ``gate_up_proj`` matmuls, RoPE
(looked up by each row's absolute position) — runs on all ``T`` rows at once. The only place
where rows must know which sequence they belong to is attention: each layer hands its new
q/k/v and that layer's KV cache to the attention backend together with the step's
:class:`AttentionMetadata`. The backend writes the new K/V into the cache at ``slot_mapping``
and lets every query row attend to its sequence's earlier tokens, read from the cache through
the block table. The model itself never sees the cache layout.

Differences from HF's modules are deliberate and numerically neutral: q/k/v are one matmul
(``qkv_proj``), gate/up are one matmul (``gate_up_proj``), and the RoPE cos/sin table is
computed once for all positions instead of on every forward. The residual stream is carried
as vLLM does, ``(hidden, residual)`` with ``residual += hidden`` folded into the next norm, so
that the optional fused kernels (:class:`~engine.fused_ops.FusedOps`, set by
:meth:`CausalLM.use_fused_ops`) can do add + RMSNorm in one pass; the eager form is the same
additions in the same order as HF's ``x = x + attn(norm(x))``.

Every projection is a :class:`engine.weight_copies.Linear`: the kernels' copies of its weight
(oneDNN-prepacked, skinny-GEMM panels, GGUF blocks) and the choice among them by row count live
there; :meth:`CausalLM.prepack` and :meth:`CausalLM.use_quantized_weights` fill them in.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.fused_ops import FusedOps
from engine.host_memory import huge_page_empty
from engine.integer_gemm import IntegerGemm
from engine.model_config import ModelConfig
from engine.native_layers import NativeLayers
from engine.quantized_gemm import QuantizedGemm, QuantizedWeight
from engine.skinny_gemm import SkinnyGemm
from engine.weight_copies import Linear, WeightCopies, prepack_weight
from engine.interfaces.attention import AttentionBackend

KVCache = tuple[torch.Tensor, torch.Tensor]
AttentionParts = list[tuple[int, int, AttentionMetadata]]  # (row_start, row_end, metadata of those rows)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in float32 like HF."""

    fused_ops: FusedOps | None = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = residual + x`` (``x`` alone for the first norm), then ``(norm(residual), residual)``.

        With fused ops: one kernel, and a given ``residual`` is updated in place."""
        if self.fused_ops is not None:
            return self.fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x if residual is None else residual + x
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel, bit-equal to the HF form below in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in HF's rotate_half convention with one float32 cos/sin table for all positions.

    ``cos_sin[p, 0]`` / ``cos_sin[p, 1]`` hold ``cos(p * f)`` / ``sin(p * f)`` for the
    ``head_dim`` frequencies ``f = cat(inv_freq, inv_freq)``.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos_sin", self._table(None), persistent=False)
        self.register_buffer("sin_sign", self._sign(None), persistent=False)

    def _table(self, device: torch.device | None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return torch.stack((angles.cos(), angles.sin()), dim=1)

    def _sign(self, device: torch.device | None) -> torch.Tensor:
        half = self.head_dim // 2
        return torch.cat((torch.full((half,), -1.0, device=device), torch.ones(half, device=device)))

    def rebuild(self, device: torch.device | str) -> None:
        """Recompute the table on ``device`` (used after building the model on ``meta``)."""
        self.cos_sin = self._table(torch.device(device))
        self.sin_sign = self._sign(torch.device(device))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, signed_sin`` of shape ``[T, 1, head_dim]`` in ``dtype`` (broadcast over heads).

        ``signed_sin`` is ``sin`` with its first half negated: :func:`apply_rope` multiplies it
        with the swapped halves ``cat(x2, x1)``, which gives ``rotate_half(x) * sin`` exactly
        (a sign flip is exact) without a negation kernel per layer.
        """
        cos, sin = self.cos_sin[positions].to(dtype).unbind(1)
        return cos.unsqueeze(1), (sin * self.sin_sign.to(dtype)).unsqueeze(1)


@dataclass
class RopeStep:
    """One step's RoPE inputs, computed once by :meth:`CausalLM.forward` for all layers.

    Eager form: ``cos`` / ``signed_sin`` rows ``[T, 1, head_dim]`` (see
    :meth:`RotaryEmbedding.forward`). Fused form (``fused_ops`` set): the kernel reads each
    token's row of ``table`` (``RotaryEmbedding.cos_sin``) at ``positions`` itself.
    """

    positions: torch.Tensor
    table: torch.Tensor
    cos: torch.Tensor | None = None
    signed_sin: torch.Tensor | None = None
    fused_ops: FusedOps | None = None

    def split_rotated(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v`` of a fused qkv output ``[T, Hq + 2 Hkv, D]`` with RoPE applied to q and k."""
        qk_heads = num_heads + num_kv_heads
        if self.fused_ops is not None:  # in place on the fresh qkv buffer: q, k, v stay views of it
            self.fused_ops.rope_(qkv, qk_heads, self.positions, self.table)
            return qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        # RoPE on q and k together: one call over the first Hq + Hkv heads of the qkv output.
        q, k = apply_rope(qkv[:, :qk_heads], self.cos, self.signed_sin).split([num_heads, num_kv_heads], dim=1)
        return q, k, qkv[:, qk_heads:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]``: HF's ``x * cos + rotate_half(x) * sin``.

    ``rotate_half(x) * sin = cat(-x2, x1) * sin = cat(x2, x1) * signed_sin`` (see
    :meth:`RotaryEmbedding.forward`); swapping the halves is one ``flip`` of a ``[.., 2, D/2]``
    view, so RoPE is four kernels (flip, mul, mul, add) instead of five, and the model calls it
    once for q and k together. Bit-equal to the HF form (``addcmul`` measured 1.2x faster but
    is not: its fused multiply-add rounds once). ``x`` may be a strided view (q and k straight
    out of the fused qkv output); the result is contiguous.
    """
    swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


class Attention(nn.Module):
    """Fused q/k/v projection, RoPE, the backend's paged attention, output projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeStep,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        attention: AttentionBackend,
        parts: AttentionParts | None = None,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x).view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = rope.split_rotated(qkv, self.num_heads, self.num_kv_heads)
        if parts is None:
            out = attention.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        else:  # a mixed step, attended per run of sequences (see CausalLM.forward)
            out = torch.cat([
                attention.forward(q[start:end], k[start:end], v[start:end], kv_cache[0], kv_cache[1], part, self.scale)
                for start, end, part in parts
            ])
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    fused_ops: FusedOps | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            return self.down_proj(self.fused_ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # SiLU in place on the (fresh) gate_up output, then one multiply: one temporary fewer.
        return self.down_proj(F.silu(gate, inplace=True).mul(up))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x += attn(norm(x)); x += mlp(norm(x))``, carried as ``(hidden, residual)``:
    each norm first adds the previous block's output into the residual stream."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeStep,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        attention: AttentionBackend,
        parts: AttentionParts | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream before it)``; the next norm adds the two."""
        hidden, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, metadata, attention, parts)
        hidden, residual = self.post_attention_layernorm.add_norm(hidden, residual)
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    """Llama / SmolLM2 / Qwen2 decoder over a flat token batch (see the module docstring).

    Parameter names follow HF's except for the fused ``self_attn.qkv_proj`` (rows: q, then k,
    then v) and ``mlp.gate_up_proj`` (rows: gate, then up); there is no ``lm_head`` when the
    embeddings are tied. ``engine.loader`` maps HF checkpoints onto these names.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._tied_head = WeightCopies()  # the kernels' copies of the embedding as LM head (tied models)
        self.fused_ops: FusedOps | None = None
        self.native_layers: NativeLayers | None = None

    @property
    def logits_weight(self) -> torch.Tensor:
        """The LM head's weight ``[vocab_size, hidden_size]`` (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def logits_head(self) -> WeightCopies:
        """The kernels' copies of :attr:`logits_weight` (the untied ``lm_head`` keeps its own)."""
        return self._tied_head if self.lm_head is None else self.lm_head

    def use_native_layers(self, native_layers: NativeLayers | None) -> None:
        """Run the decoder layers of decode-sized steps as one C call each (:mod:`engine.native_layers`:
        the same kernels as the Python layers, called from C), or always in Python (``None``)."""
        self.native_layers = native_layers

    def use_fused_ops(self, fused_ops: FusedOps | None) -> None:
        """Run RMSNorm (+ residual add), RoPE and SiLU-and-multiply through ``fused_ops``
        (CPU float32 C kernels, :mod:`engine.fused_ops`), or the eager PyTorch forms (``None``)."""
        self.fused_ops = fused_ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.fused_ops = fused_ops

    def prepack(self, min_rows: int = 1, batch_hint: int = 32, skinny_gemm: SkinnyGemm | None = None,
                packed_dtype: torch.dtype = torch.float32) -> None:
        """Give every projection (and the LM head) a oneDNN-prepacked weight copy in ``packed_dtype``
        (float32, or bfloat16 for reduced-precision prefill), and with ``skinny_gemm`` also its
        float32 panel copy for inputs of few rows.

        A CPU float32 model only (see :func:`engine.weight_copies.onednn_linear_supported`). Costs one extra copy of the
        linear weights in memory per packing; the originals stay for ``state_dict``.
        """
        # every projection, then the LM head: the order a step reads them (forward order)
        copies = [(module, module.weight) for module in self.modules() if isinstance(module, Linear) and module is not self.lm_head]
        copies.append((self.logits_head, self.logits_weight))
        for holder, weight in copies:
            holder.packed = prepack_weight(weight, batch_hint, packed_dtype)
            holder.min_rows = min_rows
        if skinny_gemm is not None:
            # All panels in one huge-page buffer, in that order: one stream of weights per decode step.
            sizes = [skinny_gemm.packed_numel(*weight.shape) for _, weight in copies]
            for (holder, weight), out in zip(copies, huge_page_empty(sum(sizes), skinny_gemm.dtype).split(sizes)):
                holder.skinny_gemm, holder.skinny = skinny_gemm, skinny_gemm.pack(weight, out)
                holder.skinny_max_rows = skinny_gemm.max_rows

    def use_quantized_weights(
        self, gemm: QuantizedGemm, blocks: Mapping[str, tuple[str, torch.Tensor]], integer_gemm: IntegerGemm | None = None,
    ) -> dict[str, int]:
        """Give every projection and the LM head whose weight is in ``blocks`` (our parameter name ->
        (GGUF type, raw blocks), :func:`engine.loader.load_quantized_blocks`) a copy packed for
        ``gemm``, used for inputs of at most ``gemm.max_rows`` rows, and, with ``integer_gemm``, one
        packed for it, used above those rows up to ``integer_gemm.max_rows``. Returns the count per type."""
        def pack(name: str, kernel: QuantizedGemm | IntegerGemm, out_features: int, in_features: int) -> QuantizedWeight:
            qtype, data = blocks[name]
            weight = kernel.pack(data, qtype, in_features)
            if weight.out_features != out_features:
                raise ValueError(f"{name}: {qtype} blocks hold {weight.out_features} rows, the model {out_features}")
            return weight

        def attach(copies: WeightCopies, name: str, out_features: int, in_features: int) -> None:
            copies.quantized_gemm = gemm
            copies.quantized = pack(name, gemm, out_features, in_features)
            if integer_gemm is not None:
                copies.integer_gemm = integer_gemm
                copies.integer = pack(name, integer_gemm, out_features, in_features)
            counts[blocks[name][0]] = counts.get(blocks[name][0], 0) + 1

        counts: dict[str, int] = {}
        for name, module in self.named_modules():
            if isinstance(module, Linear) and module is not self.lm_head and f"{name}.weight" in blocks:
                attach(module, f"{name}.weight", module.out_features, module.in_features)
        head = "embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        if head in blocks:
            attach(self.logits_head, head, self.config.vocab_size, self.config.hidden_size)
        return counts

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        attention: AttentionBackend,
        attention_parts: AttentionParts | None = None,
    ) -> torch.Tensor:
        """Final (normed) hidden states ``[T, hidden_size]`` of the ``T`` flattened new tokens.

        ``kv_caches[i]`` is layer ``i``'s ``(k_cache, v_cache)``, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]``; the backend writes this step's
        K/V into them.

        ``attention_parts`` (optional, from the runner): ``(row_start, row_end, metadata)`` for
        consecutive runs of sequences that together cover the step. Attention is then called
        once per run on its rows, so the decode rows of a mixed step keep the backend's
        decode-only path instead of being padded to the longest prompt of the step (gather
        backends pad every sequence's queries to ``max_query_len``). The dense layers still
        run once over all ``T`` rows.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV-cache pairs for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)
        native_layers = self.native_layers
        # A backend that attends a whole mixed step in one call as fast as run by run (cpu_paged: no
        # padding) is not kept off the C layers by the runs the runner split the step into.
        whole_step = attention_parts is None or getattr(attention, "mixed_steps_in_one_call", False)
        if native_layers is not None and whole_step and native_layers.can_run(hidden.shape[0], attention, metadata):
            hidden, residual = native_layers.forward(hidden, positions, kv_caches, metadata, attention)
            return self.norm.add_norm(hidden, residual)[0]
        if self.fused_ops is not None:
            rope = RopeStep(positions, self.rotary.cos_sin, fused_ops=self.fused_ops)
        else:
            cos, signed_sin = self.rotary(positions, hidden.dtype)
            rope = RopeStep(positions, self.rotary.cos_sin, cos, signed_sin)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, kv_cache, metadata, attention, attention_parts)
        return self.norm.add_norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab_size]`` for selected rows of :meth:`forward`'s output."""
        return self.logits_head.matmul(hidden, self.logits_weight, None).float()
