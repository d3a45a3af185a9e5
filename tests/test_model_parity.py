"""Our decoder against HF transformers on the same random checkpoints, and the loader.

Attention runs through a naive reference backend defined here (write K/V with ``write_kv``,
then per-sequence causal attention over the context gathered from the paged cache), so these
tests depend only on the shared contracts, not on any real backend.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from engine.attention_metadata import AttentionMetadata
from engine.loader import build_random_checkpoint, checkpoint_for_spec, load_model, model_spec, resolve_checkpoint
from engine.model import CausalLM
from engine.model_config import ModelConfig
from engine.interfaces.attention import AttentionBackend, write_kv

BLOCK_SIZE = 4
PROMPTS = [[5, 17, 42, 9, 77, 3, 120, 64, 11, 200, 31], [8, 250, 13, 99, 4, 150]]  # ragged, cross blocks


class NaiveAttention:
    """Reference backend: per-sequence gather + masked softmax attention, GQA by repeating heads."""

    name = "naive_reference"
    attention_pairs = "padded"  # full query x context scores per sequence, masked (not skipped)

    def forward(self, query, key, value, k_cache, v_cache, metadata: AttentionMetadata, scale: float):
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        num_kv_heads, head_dim = k_cache.shape[-2:]
        group = query.shape[1] // num_kv_heads
        flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
        out = torch.empty_like(query)
        for i in range(metadata.num_seqs):
            start, end = int(metadata.query_start_loc[i]), int(metadata.query_start_loc[i + 1])
            ctx = int(metadata.context_lens[i])
            pos = torch.arange(ctx)
            block_size = metadata.block_size
            slots = metadata.block_tables[i, pos // block_size].long() * block_size + pos % block_size
            k = flat_k[slots].repeat_interleave(group, dim=1).float()
            v = flat_v[slots].repeat_interleave(group, dim=1).float()
            scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale
            q_pos = torch.arange(ctx - (end - start), ctx)
            scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
        return out


def make_step(seqs: list[tuple[list[int], int]], max_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flatten ``(new_tokens, num_computed)`` per sequence; sequence i owns contiguous blocks."""
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    ids, positions, slots, qlens, ctxs = [], [], [], [], []
    for i, (tokens, computed) in enumerate(seqs):
        ids += tokens
        positions += range(computed, computed + len(tokens))
        slots += [i * blocks_per_seq * BLOCK_SIZE + p for p in range(computed, computed + len(tokens))]
        qlens.append(len(tokens))
        ctxs.append(computed + len(tokens))
    tables = torch.arange(len(seqs) * blocks_per_seq, dtype=torch.int32).view(len(seqs), blocks_per_seq)
    qlens_t = torch.tensor(qlens, dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), qlens_t.cumsum(0).int()]),
        query_lens=qlens_t,
        context_lens=torch.tensor(ctxs, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        block_size=BLOCK_SIZE,
        max_query_len=max(qlens),
        max_context_len=max(ctxs),
    )
    return torch.tensor(ids), torch.tensor(positions), metadata


def empty_caches(
    config: ModelConfig, num_seqs: int, max_len: int, dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_seqs * -(-max_len // BLOCK_SIZE), BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(config.num_hidden_layers)]


@torch.inference_mode()
def our_prefill_logits(model: CausalLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of every prompt token, all prompts in one flat varlen step."""
    max_len = max(map(len, prompts))
    ids, positions, metadata = make_step([(p, 0) for p in prompts], max_len)
    caches = empty_caches(model.config, len(prompts), max_len, model.embed_tokens.weight.dtype)
    hidden = model(ids, positions, caches, metadata, NaiveAttention())
    return model.compute_logits(hidden)


@torch.inference_mode()
def hf_logits(hf, prompts: list[list[int]]) -> torch.Tensor:
    """HF logits of every prompt token, one unpadded forward per prompt, concatenated."""
    return torch.cat([hf(torch.tensor([p])).logits[0].float() for p in prompts])


@pytest.fixture(params=["tiny_llama_ckpt", "tiny_qwen2_ckpt", "odd_ckpt"])
def ckpt(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def test_naive_backend_follows_protocol() -> None:
    assert isinstance(NaiveAttention(), AttentionBackend)


def test_prefill_logits_match_hf(ckpt: Path, hf_model) -> None:
    model, config = load_model(ckpt, torch.float32, "cpu")
    ours = our_prefill_logits(model, PROMPTS)
    assert ours.dtype == torch.float32 and ours.shape == (sum(map(len, PROMPTS)), config.vocab_size)
    torch.testing.assert_close(ours, hf_logits(hf_model(ckpt), PROMPTS), atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_prefill_then_decode_matches_hf(ckpt: Path, hf_model) -> None:
    """Prefill all but the last token, then one decode step per sequence reading the cache."""
    model, config = load_model(ckpt, torch.float32, "cpu")
    max_len = max(map(len, PROMPTS))
    caches = empty_caches(config, len(PROMPTS), max_len)
    ids, positions, metadata = make_step([(p[:-1], 0) for p in PROMPTS], max_len)
    model(ids, positions, caches, metadata, NaiveAttention())
    ids, positions, metadata = make_step([(p[-1:], len(p) - 1) for p in PROMPTS], max_len)
    ours = model.compute_logits(model(ids, positions, caches, metadata, NaiveAttention()))
    last_rows = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    expected = hf_logits(hf_model(ckpt), PROMPTS)[last_rows]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_wrong_rope_theta_is_caught(tiny_llama_ckpt: Path, hf_model) -> None:
    """The parity check must be able to fail: a model built with a wrong RoPE base."""
    model, config = load_model(tiny_llama_ckpt, torch.float32, "cpu")
    broken = CausalLM(dataclasses.replace(config, rope_theta=config.rope_theta * 2)).eval()
    broken.load_state_dict(model.state_dict())
    diff = (our_prefill_logits(broken, PROMPTS) - hf_logits(hf_model(tiny_llama_ckpt), PROMPTS)).abs().max()
    assert diff > 1e-2


def test_random_init_has_clear_greedy_margins(tiny_llama_ckpt: Path) -> None:
    model, _ = load_model(tiny_llama_ckpt, torch.float32, "cpu")
    top2 = our_prefill_logits(model, PROMPTS).topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.3


def test_sharded_checkpoint_round_trip(tiny_llama_ckpt: Path, tmp_path: Path) -> None:
    with safe_open(str(tiny_llama_ckpt / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    names = sorted(tensors)
    weight_map = {}
    for shard, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(tiny_llama_ckpt / "config.json", tmp_path)
    sharded, _ = load_model(tmp_path, torch.float32, "cpu")
    single, _ = load_model(tiny_llama_ckpt, torch.float32, "cpu")
    assert torch.equal(our_prefill_logits(sharded, PROMPTS), our_prefill_logits(single, PROMPTS))


@pytest.mark.parametrize("change", ["drop", "add"])
def test_missing_or_extra_tensor_is_an_error(tiny_llama_ckpt: Path, tmp_path: Path, change: str) -> None:
    with safe_open(str(tiny_llama_ckpt / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if change == "drop":
        del tensors["model.layers.1.self_attn.k_proj.weight"]
    else:
        tensors["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(tiny_llama_ckpt / "config.json", tmp_path)
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj"):
        load_model(tmp_path, torch.float32, "cpu")


def test_load_model_dtype_and_device(tiny_qwen2_ckpt: Path) -> None:
    model, config = load_model(tiny_qwen2_ckpt, torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos_sin.dtype == torch.float32 and not model.training
    assert config.eos_token_ids == (2, 3) and config.eos_token_id == 2 and config.attention_bias


def test_pretrained_missing_suggests_random_weights() -> None:
    spec = {"name": "ghost", "hub_id": "servelab-test/does-not-exist", "weights": "pretrained"}
    with pytest.raises(FileNotFoundError, match="model.weights=random"):
        checkpoint_for_spec(spec)
    with pytest.raises(FileNotFoundError, match="model.weights=random"):
        resolve_checkpoint("tiny", weights="pretrained")


def test_random_checkpoint_is_built_once(tmp_path: Path) -> None:
    first = resolve_checkpoint("tiny", weights="random", cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_checkpoint("tiny", cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_checkpoint("tiny", cache_dir=tmp_path, seed=1) != first
    assert checkpoint_for_spec(OmegaConf.create(model_spec("tiny")), tmp_path) == first  # Hydra's cfg.model
    assert first.parent == tmp_path / "checkpoints"
    _, config = load_model(first, torch.float32, "cpu")
    assert config.vocab_size == 512 and config.max_model_len == 512


def test_folder_is_used_directly(tiny_llama_ckpt: Path) -> None:
    assert resolve_checkpoint(str(tiny_llama_ckpt), weights="pretrained") == tiny_llama_ckpt


def test_random_checkpoint_is_deterministic(tmp_path: Path) -> None:
    hf_config = model_spec("tiny")["hf_config"]
    a = build_random_checkpoint(hf_config, tmp_path / "a", seed=3)
    b = build_random_checkpoint(hf_config, tmp_path / "b", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "override, message",
    [
        ({"model_type": "gpt2"}, "unsupported model_type"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "RoPE scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_unsupported_configs_are_rejected(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**model_spec("tiny")["hf_config"], **override})


def test_config_reads_transformers_v5_rope_parameters() -> None:
    hf = {k: v for k, v in model_spec("tiny")["hf_config"].items() if k not in ("rope_theta", "head_dim")}
    config = ModelConfig.from_hf_config({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert config.rope_theta == 5e5 and config.head_dim == 16 and config.max_model_len == 512
