"""The architecture numbers our decoder needs, read from a Hugging Face ``config.json``.

Only the Llama family (Llama, SmolLM2, Mistral without sliding window) and Qwen2 are
supported; anything whose forward pass would differ from ours (RoPE scaling, sliding-window
attention, MLP bias, a non-SiLU activation) is rejected with a ``ValueError`` rather than
silently computed wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# model_type in config.json -> our architecture name
_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_DEFAULTS = {  # HF's own defaults for keys a config.json may omit
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096 * 32},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
}


@dataclass(frozen=True)
class ModelConfig:
    """Decoder architecture of one checkpoint.

    Attributes:
        architecture: ``"llama"`` (Llama, SmolLM2, Mistral) or ``"qwen2"``.
        vocab_size: rows of the embedding / columns of the logits.
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: decoder layers (one KV-cache pair each).
        num_attention_heads: query heads.
        num_key_value_heads: K/V heads (GQA: divides ``num_attention_heads``).
        head_dim: per-head width (default ``hidden_size // num_attention_heads``).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base frequency.
        tie_word_embeddings: logits reuse the input embedding matrix (no ``lm_head``).
        attention_bias: q/k/v projections carry a bias (always for qwen2).
        o_proj_bias: the output projection carries a bias (llama with ``attention_bias``).
        max_position_embeddings: positions the RoPE table covers.
        max_model_len: longest context (prompt + output) the engine accepts;
            equals ``max_position_embeddings``.
        bos_token_id: beginning-of-sequence id, or ``None``.
        eos_token_ids: every end-of-sequence id (config's int or list), possibly empty.
        checkpoint_dtype: dtype the checkpoint declares (``"bfloat16"``...), or ``None``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    max_position_embeddings: int
    max_model_len: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str | None = None

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (``None`` if the config has none)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def q_size(self) -> int:
        """Width of the concatenated query heads."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the concatenated key (or value) heads."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Parse (and validate) the dict loaded from an HF ``config.json``."""
        model_type = hf.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: servelab implements "
                f"{sorted(_ARCHITECTURES)} (Llama family and Qwen2)"
            )
        defaults = _DEFAULTS[model_type]
        _check_supported(hf, model_type)
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        rope = hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", rope.get("rope_theta", defaults["rope_theta"]))
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
        bias = model_type == "qwen2" or bool(hf.get("attention_bias", False))
        max_pos = int(hf.get("max_position_embeddings", defaults["max_position_embeddings"]))
        dtype = hf.get("torch_dtype", hf.get("dtype"))
        return cls(
            architecture=_ARCHITECTURES[model_type],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias,
            o_proj_bias=model_type != "qwen2" and bias,
            max_position_embeddings=max_pos,
            max_model_len=max_pos,
            bos_token_id=None if hf.get("bos_token_id") is None else int(hf["bos_token_id"]),
            eos_token_ids=eos_ids,
            checkpoint_dtype=None if dtype is None else str(dtype),
        )


def _check_supported(hf: Mapping[str, Any], model_type: str) -> None:
    """Raise ``ValueError`` for config features our forward pass does not implement."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"unsupported RoPE scaling {rope_type!r}: only plain (default) RoPE is implemented")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}: only SwiGLU with silu is implemented")
    if hf.get("mlp_bias", False):
        raise ValueError("unsupported mlp_bias=True")
    uses_window = hf.get("use_sliding_window", model_type == "mistral")
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types") or []
    if (uses_window and window is not None and window < hf.get("max_position_embeddings", float("inf"))) or (
        "sliding_attention" in layer_types
    ):
        raise ValueError("unsupported sliding-window attention: only full causal attention is implemented")
