"""Compose servelab's config in-process and run it, for tests of workloads and load profiles."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from engine.config import CONF_DIR

#: a simulated H100 serving the tiny model: fast, on a virtual clock, no weights
SIMULATED_TINY = ["engine=simulated", "hardware=h100", "model=tiny", "driver.progress=false", "plots=false"]


def compose_config(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def choices_of(overrides: list[str]) -> dict[str, str]:
    """The group choices named in ``overrides`` (what Hydra's runtime choices would hold)."""
    groups = ("engine", "model", "cache", "scheduler", "attention", "workload", "hardware", "profile")
    pairs = dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o)
    return {g: pairs[g] for g in groups if g in pairs}


def run_once(overrides: list[str], out_dir: Path):
    """``execute`` one composed configuration into ``out_dir``; returns its outcome."""
    from experiments.harness.job import execute

    return execute(compose_config(overrides), out_dir, choices_of(overrides), overrides)
