"""What a model costs without its weights: parameter count, weight bytes, KV bytes per token.

Everything comes from the HF ``config.json`` shapes of ``conf/model/<name>.yaml``. RoPE scaling
(Llama 3.1's ``llama3`` frequencies) changes numbers, not shapes or costs, so the simulator
parses a model config with it removed; the real engine still rejects it.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine.model_config import ModelConfig


def hf_config_of(model_node: Mapping[str, Any]) -> tuple[dict[str, Any], Path | None]:
    """The HF config of a ``cfg.model`` node, and its checkpoint folder when it has one.

    Named architectures carry ``hf_config`` (no weights are touched); other models (a folder, a
    GGUF file) resolve to their checkpoint folder and its ``config.json`` is read."""
    node = OmegaConf.to_container(model_node, resolve=True) if isinstance(model_node, DictConfig) else dict(model_node)
    if node.get("hf_config"):
        return dict(node["hf_config"]), None
    from engine.loader import checkpoint_for_spec

    folder = Path(checkpoint_for_spec(node))
    return json.loads((folder / "config.json").read_text()), folder


def model_config_for_costs(hf_config: Mapping[str, Any]) -> ModelConfig:
    """Parse an HF config for simulation (RoPE scaling dropped: it does not change the cost)."""
    hf = {key: value for key, value in dict(hf_config).items() if key != "rope_scaling"}
    return ModelConfig.from_hf_config(hf)


def layer_parameters(mc: ModelConfig) -> int:
    """Weights of one decoder layer: q/k/v/o projections (+ biases), SwiGLU MLP, two RMSNorms."""
    attention = mc.hidden_size * (mc.q_size + 2 * mc.kv_size) + mc.q_size * mc.hidden_size
    if mc.attention_bias:
        attention += mc.q_size + 2 * mc.kv_size
    if mc.o_proj_bias:
        attention += mc.hidden_size
    return attention + 3 * mc.hidden_size * mc.intermediate_size + 2 * mc.hidden_size


def parameter_count(mc: ModelConfig) -> int:
    """All weights: embedding, layers, final norm and (unless tied) the LM head."""
    embedding = mc.vocab_size * mc.hidden_size
    lm_head = 0 if mc.tie_word_embeddings else embedding
    return embedding + lm_head + mc.num_hidden_layers * layer_parameters(mc) + mc.hidden_size


def weight_bytes_read_per_step(mc: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of weights one forward pass streams: every layer and the LM head (the embedding is
    a gather of a few rows, not a read of the table)."""
    return (mc.num_hidden_layers * layer_parameters(mc) + mc.vocab_size * mc.hidden_size + mc.hidden_size) * dtype_bytes


def linear_flops_per_token(mc: ModelConfig) -> int:
    """Multiply-adds x 2 of the layers' linear projections for one token row."""
    return 2 * mc.num_hidden_layers * layer_parameters(mc)


def lm_head_flops_per_row(mc: ModelConfig) -> int:
    return 2 * mc.vocab_size * mc.hidden_size


def attention_flops_per_pair(mc: ModelConfig) -> int:
    """FLOPs of one query-key pair over all layers and heads: q.k and p.v, 2 x head_dim each."""
    return 4 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim


def kv_bytes_per_token(mc: ModelConfig, dtype_bytes: int) -> int:
    """K and V of one token over all layers."""
    return 2 * mc.num_hidden_layers * mc.kv_size * dtype_bytes
