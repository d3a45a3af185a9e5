"""Build the engine's config from strategy names, using the same YAML files as Hydra.

``LLM(cache="paged", block_size=4)`` and ``python run.py cache=paged cache.block_size=4``
compose the same node: ``conf/cache/paged.yaml`` with ``block_size`` overridden. The YAML files'
``_target_`` is the only registry of strategies.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def available(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def load_group_option(group: str, name: str, overrides: dict[str, Any]) -> DictConfig:
    """Load ``conf/<group>/<name>.yaml`` and apply ``overrides`` (``None`` values are skipped).

    Raises ``ValueError`` for an unknown name or an option the strategy does not have.
    """
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown {group} {name!r}; available: {', '.join(available(group))}")
    node = OmegaConf.load(path)
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in node:
            raise ValueError(f"{group} {name!r} has no option {key!r}; its options: {', '.join(k for k in node if k != '_target_')}")
        node[key] = value
    return node


def model_node(model: str, weights: str | None) -> DictConfig:
    """A named model (``conf/model/<name>.yaml``; ``weights=None`` keeps its own ``weights``), a
    checkpoint folder path, or a ``.gguf`` file path (converted to a folder on first use)."""
    if (CONF_DIR / "model" / f"{model}.yaml").is_file():
        node = OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml")
        if weights is not None:
            node.weights = weights
        return node
    path = Path(model).expanduser()
    if path.is_dir() or (path.suffix == ".gguf" and path.is_file()):
        return OmegaConf.create({"name": path.stem if path.is_file() else path.name, "path": str(path), "weights": "pretrained"})
    raise ValueError(f"unknown model {model!r}: not a folder, not a .gguf file and not one of {', '.join(available('model'))}")


def engine_config(
    model: str,
    cache: str,
    scheduler: str,
    attention: str,
    device: str,
    dtype: str,
    weights: str | None,
    seed: int,
    cache_options: dict[str, Any],
    scheduler_options: dict[str, Any],
    attention_options: dict[str, Any] | None = None,
) -> DictConfig:
    return OmegaConf.create(
        {
            "model": model_node(model, weights),
            "cache": load_group_option("cache", cache, cache_options),
            "scheduler": load_group_option("scheduler", scheduler, scheduler_options),
            "attention": load_group_option("attention", attention, attention_options or {}),
            "device": device,
            "dtype": dtype,
            "seed": seed,
        }
    )


def instantiate_strategy(node: DictConfig, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node, **kwargs)``, re-raising a strategy's own ``ValueError``
    (bad option values) as itself rather than wrapped in Hydra's ``InstantiationException``."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        if isinstance(error.__cause__, ValueError):
            raise error.__cause__ from None
        raise
