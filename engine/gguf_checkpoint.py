"""Turn a GGUF file (llama.cpp's checkpoint format) into an ordinary Hugging Face folder.

A GGUF file is one self-describing blob: a key/value metadata section (architecture,
hyperparameters under ``<arch>.*``, the tokenizer under ``tokenizer.ggml.*``, the chat template
under ``tokenizer.chat_template``) followed by tensors, many of them quantized in blocks (Q4_1:
32 weights share a float16 scale and minimum and are stored in 4 bits each; Q8_0: 32 weights
share a scale, 8 bits each; K-quants nest such blocks in super-blocks of 256).

servelab serves one format, HF ``config.json`` + ``*.safetensors``. :func:`materialize_gguf`
converts a GGUF file *once* into such a folder under the servelab cache, so the engine, the HF
peers and the tests all load the very same weights:

* every tensor is dequantized with the ``gguf`` package (``gguf.quants.dequantize``: F32, F16,
  BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants, IQ and TQ types) to float32 — quantization is lossy
  once, in the file; from there the engine computes in its own dtype;
* tensor names are mapped back to HF's (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn
  .q_proj.weight``);
* llama.cpp's converter permutes the rows of Llama's Q and K projections (it stores each head's
  rotary pairs interleaved, GPT-J style, where HF keeps the two halves apart, rotate_half style);
  the inverse permutation is applied here. Qwen2 files are not permuted;
* no ``output.weight`` means the LM head is tied to the token embedding;
* the tokenizer and chat template are converted by ``transformers`` (its GGUF tokenizer
  converters) and saved as ``tokenizer.json`` / ``tokenizer_config.json``;
* the matrices stored as Q4_1 or Q8_0 (the types :mod:`engine.quantized_gemm` reads) are also
  kept as they are in the file, their raw blocks (Q/K rows un-permuted: a row is whole blocks),
  in ``gguf_blocks/blocks.safetensors`` (uint8 ``[rows, bytes per row]`` under the HF name, the
  type in the file's metadata). Decode steps then read 4- or 8-bit weights instead of float32
  (:func:`load_gguf_blocks`; ``quantized_weights`` in ``conf/engine/servelab.yaml``); the float32
  tensors stay the checkpoint (prefill, other devices, the HF peers). Other types: float32 only.

Folders are written to a temporary name and renamed, so a crash never leaves half a checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.paths import cache_root
from engine.quantized_gemm import GGML_TYPES

CONVERTER_VERSION = 2  # bump when the conversion changes: it is part of the cache key (2: gguf_blocks/)
BLOCKS_FILE = Path("gguf_blocks") / "blocks.safetensors"  # in a subfolder: not a shard of the checkpoint
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_LAYER_TENSORS = {  # GGUF per-block tensor -> HF per-layer tensor
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def materialize_gguf(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The HF checkpoint folder converted from ``gguf_path`` (built on first use, then cached).

    The cache key is the file's resolved path, size and modification time plus
    :data:`CONVERTER_VERSION`. Raises ``ValueError`` for an unreadable, truncated or corrupt
    file, an unsupported architecture or an unsupported tensor type.
    """
    source = Path(gguf_path).expanduser().resolve()
    if not source.is_file():
        raise ValueError(f"GGUF file {source} does not exist")
    stat = source.stat()
    key = hashlib.sha256(
        json.dumps([str(source), stat.st_size, stat.st_mtime_ns, CONVERTER_VERSION]).encode()
    ).hexdigest()[:10]
    final = cache_root(cache_dir) / "checkpoints" / f"gguf-{source.stem}-{key}"
    if (final / "config.json").is_file():
        return final
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_gguf(source, tmp)
        tmp.rename(final)
    except OSError:  # another process finished first: keep its copy
        if not (final / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(source: Path, out_dir: Path) -> None:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` and (when the file
    has one) the tokenizer of the GGUF file ``source`` into ``out_dir``."""
    reader = _open(source)
    fields = _metadata(reader, source)
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{source.name}: unsupported GGUF architecture {arch!r}; servelab converts {list(SUPPORTED_ARCHITECTURES)}")
    config = hf_config(fields, arch, source)
    tensors = hf_tensors(reader, config, source)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    blocks, types = hf_blocks(reader, config, source)
    if blocks:
        (out_dir / BLOCKS_FILE).parent.mkdir()
        save_file(blocks, str(out_dir / BLOCKS_FILE), metadata={"ggml_types": json.dumps(types, sort_keys=True)})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True))
    if "tokenizer.ggml.tokens" in fields:
        _save_tokenizer(source, out_dir)


def _open(source: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(source))
    except Exception as err:  # noqa: BLE001 -- the reader raises many kinds (ValueError, struct, index...)
        raise ValueError(f"{source} is not a readable GGUF file (truncated or corrupt?): {type(err).__name__}: {err}") from err


def _metadata(reader: Any, source: Path) -> dict[str, Any]:
    """Every metadata field as a Python value (token and merge lists only counted, not decoded)."""
    values: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            values[name] = len(field.data)
            continue
        try:
            values[name] = field.contents()
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"{source.name}: metadata field {name!r} is unreadable (corrupt file?): {err}") from err
    return values


def hf_config(fields: dict[str, Any], arch: str, source: Path) -> dict[str, Any]:
    """The HF ``config.json`` for the GGUF metadata ``fields`` of architecture ``arch``."""
    def need(key: str) -> Any:
        if f"{arch}.{key}" not in fields:
            raise ValueError(f"{source.name}: metadata key {arch}.{key} is missing")
        return fields[f"{arch}.{key}"]

    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{source.name}: unsupported RoPE scaling {scaling!r}: only plain RoPE is implemented")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = fields.get(f"{arch}.vocab_size", fields.get("tokenizer.ggml.tokens"))
    if vocab is None:
        raise ValueError(f"{source.name}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")
    eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in fields]
    eos = sorted({int(e) for e in eos}, key=eos.index)
    config = {
        "model_type": arch,
        "architectures": [_HF_ARCHITECTURES[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(fields.get(f"{arch}.attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "servelab_gguf": {"file": source.name, "converter_version": CONVERTER_VERSION},
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def hf_tensors(reader: Any, config: dict[str, Any], source: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to float32, under its HF name (Q/K un-permuted for Llama)."""
    from gguf.quants import dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, source)
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as err:
            raise ValueError(f"{source.name}: tensor {tensor.name} has unsupported type {tensor.tensor_type.name} "
                             f"(the gguf package cannot dequantize it)") from err
        except (ValueError, IndexError) as err:  # data shorter than the tensor's shape: truncated file
            raise ValueError(f"{source.name}: tensor {tensor.name} is unreadable (truncated or corrupt file?): {err}") from err
        expected = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        values = np.array(values, dtype=np.float32).reshape(expected)  # a copy: the reader's arrays map the file
        if config["model_type"] == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_rotary_rows(values, heads)
        elif config["model_type"] == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_rotary_rows(values, kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values))
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{source.name}: no token_embd.weight tensor (corrupt file?)")
    return tensors


def hf_blocks(reader: Any, config: dict[str, Any], source: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The raw blocks of every Q4_1 / Q8_0 matrix, ``[rows, bytes per row]`` uint8 under its HF name
    (Q/K rows un-permuted for Llama, as in :func:`hf_tensors`), and each one's type name."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    blocks, types = {}, {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in GGML_TYPES or len(tensor.shape) != 2:
            continue
        name = hf_tensor_name(tensor.name, source)
        rows = np.array(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[1]), -1)
        if config["model_type"] == "llama" and name.endswith("q_proj.weight"):
            rows = unpermute_rotary_rows(rows, heads)
        elif config["model_type"] == "llama" and name.endswith("k_proj.weight"):
            rows = unpermute_rotary_rows(rows, kv_heads)
        blocks[name] = torch.from_numpy(np.ascontiguousarray(rows))
        types[name] = tensor.tensor_type.name
    return blocks, types


def load_gguf_blocks(folder: str | Path) -> dict[str, tuple[str, torch.Tensor]]:
    """HF name -> (type name, raw blocks) of a folder :func:`materialize_gguf` wrote; ``{}`` for
    any other checkpoint (or a GGUF file with no Q4_1 / Q8_0 matrix)."""
    path = Path(folder) / BLOCKS_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        types = json.loads(f.metadata()["ggml_types"])
        return {name: (types[name], f.get_tensor(name)) for name in f.keys()}


def hf_tensor_name(gguf_name: str, source: Path) -> str:
    """``blk.<i>.<tensor>.<kind>`` / ``<tensor>.<kind>`` -> the HF tensor name; ``ValueError`` if unknown."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    raise ValueError(f"{source.name}: unsupported tensor {gguf_name!r} (servelab's Llama/Qwen2 decoder has no such weight)")


def unpermute_rotary_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for one projection (weight or bias).

    llama.cpp's converter reorders each head's ``head_dim`` output rows from HF's two halves
    ``[x_0 .. x_{d/2-1} | x_{d/2} .. x_{d-1}]`` (rotate_half) into interleaved pairs
    ``[x_0, x_{d/2}, x_1, x_{d/2+1}, ...]``: ``reshape(heads, 2, d/2).swapaxes(1, 2)``. The
    inverse is ``reshape(heads, d/2, 2).swapaxes(1, 2)``.
    """
    rows = values.shape[0]
    return values.reshape(num_heads, rows // num_heads // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def _save_tokenizer(source: Path, out_dir: Path) -> None:
    """The file's tokenizer and chat template as HF tokenizer files (``transformers`` converts them)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{source.name}: its tokenizer metadata cannot be converted: {type(err).__name__}: {err}") from err
    tokenizer.save_pretrained(str(out_dir))
