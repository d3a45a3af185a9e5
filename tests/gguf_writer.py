"""Write small GGUF files from HF checkpoints, the way llama.cpp's converter lays them out (tests only).

Tensor names go HF -> GGUF, Llama's Q/K rows are permuted as ``convert_hf_to_gguf.py`` does, and
matrices can be quantized with the ``gguf`` package, so servelab's reader can be checked against
both the original checkpoint and transformers' own GGUF loader.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute_like_llama_cpp(values: np.ndarray, heads: int) -> np.ndarray:
    return values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def write_gguf(
    checkpoint: Path,
    out: Path,
    matrix_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    architecture: str | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    replace: dict[str, np.ndarray] | None = None,
) -> Path:
    """``checkpoint`` (an HF folder) as the GGUF file ``out``; 2-D weights stored as ``matrix_type``.

    ``architecture`` overrides the metadata's architecture name (to write unsupported ones);
    ``extra_tensors`` (GGUF names) are added as they are; ``replace`` (HF names) swaps a
    tensor's values, stored in their own dtype (e.g. int32, a type no converter dequantizes).
    """
    config = json.loads((checkpoint / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = GGUFWriter(str(out), architecture or arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config.get("head_dim", config["hidden_size"] // heads))
    writer.add_value_length(config.get("head_dim", config["hidden_size"] // heads))
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    eos = config["eos_token_id"]
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    for name, values in load_file(str(checkpoint / "model.safetensors")).items():
        if replace and name in replace:
            writer.add_tensor(gguf_name(name), replace[name])
            continue
        values = values.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            values = permute_like_llama_cpp(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = permute_like_llama_cpp(values, kv_heads)
        if values.ndim == 2 and matrix_type != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), quantize(values, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(values))
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
