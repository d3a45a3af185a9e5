"""Run a load profile from run.py's config: every level through ``execute``, then one table and plots.

``profile=`` (conf/profile/) selects the profile; ``profile=fixed`` (the default) is run.py's
plain single run in the output folder itself. Any other profile makes the output folder a
series folder: each run of the series is one ordinary :func:`~experiments.harness.job.execute`
of the same config (so every engine run.py runs works: in-process servelab, servelab_http,
openai, vllm, llamacpp, simulated), told its :class:`~experiments.harness.load_levels.LoadLevel`,
into a numbered subfolder with the usual files; then ``profile.md`` / ``.csv`` / ``.json`` and
``latency_vs_rate.png`` / ``goodput_vs_rate.png`` are written beside them.

    python run.py profile=rate_sweep engine=servelab_http workload=random workload.num_prompts=32
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine.config import instantiate_strategy
from experiments.harness.job import execute
from experiments.harness.load_levels import LoadLevel
from experiments.harness.profiles import FixedProfile, Profile, Series
from experiments.harness.saturation import SaturationRule
from experiments.results.profile_plots import plot_profile
from experiments.results.profile_table import profile_frame, write_profile_table


class ProfileFailed(RuntimeError):
    """A profile's anchor run failed: the series stopped without a result (its table says which)."""


def build_profile(cfg: DictConfig) -> FixedProfile | Profile:
    """The configured profile (``ValueError`` naming the field for a bad one, not Hydra's wrapper)."""
    return instantiate_strategy(cfg.profile)


def run_profile(cfg: DictConfig, profile: Profile, out_dir: Path, choices: dict[str, Any],
                overrides: list[str]) -> Series:
    """Run ``profile``'s series into ``out_dir`` and write its table and plots."""

    def execute_level(level: LoadLevel, folder: Path, saturation: SaturationRule) -> dict[str, Any]:
        return execute(cfg, folder, choices, overrides, load=level, saturation=saturation).summary

    series = Series(out_dir, execute_level, profile.saturation)
    profile.run_series(series)
    params = OmegaConf.to_container(cfg.profile, resolve=True)
    frame = profile_frame(series)
    markdown, _ = write_profile_table(profile.name, params, series, frame)
    if cfg.get("plots", True):
        title = f"{profile.name}: engine={choices.get('engine')} model={choices.get('model')} workload={choices.get('workload')}"
        plot_profile(frame, out_dir, title, series.result.get("max_goodput_rate"))
    print(f"\n{markdown}\nprofile results: {out_dir}")
    return series
