"""servelab's entry point: compose a config, build an engine, drive a workload, write results.

    python run.py                                    # default: SmolLM2-135M (random weights), burst c=8
    python run.py cache=paged scheduler=static       # one configuration
    python run.py -m scheduler=static,continuous workload.concurrency=1,8,32
    python run.py +experiment=naive_vs_continuous    # a headline result (conf/experiment/)
    python run.py profile=rate_sweep workload=random workload.num_prompts=32   # a load profile (conf/profile/)
    python -m experiments.results.report results/sweeps/<dir>

Results land in the Hydra output folder (results/runs/<time>/ or results/sweeps/<time>/<job>/):
config.yaml (resolved), requests.csv, steps.csv, summary.json, summary.md and PNG plots.
A failed single run exits nonzero; in a multirun a failed job is recorded and the sweep continues.
A load profile (``profile=`` other than ``fixed``, docs/profiles.md) runs its series into the
output folder (numbered subfolders, each with the files above) and writes profile.md/.csv/.json
and its plots there; a profile whose anchor run failed exits nonzero in a single run.
"""
from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from experiments.harness.job import execute
from experiments.harness.profile_run import ProfileFailed, build_profile, run_profile
from experiments.harness.profiles import FixedProfile


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> str:
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    choices, overrides = dict(hydra_cfg.runtime.choices), list(hydra_cfg.overrides.task)
    profile = build_profile(cfg)
    if not isinstance(profile, FixedProfile):
        series = run_profile(cfg, profile, out_dir, choices, overrides)
        if series.failed and hydra_cfg.mode == RunMode.RUN:
            raise ProfileFailed(series.stopped)
        return "failed" if series.failed else "ok"
    outcome = execute(cfg, out_dir, choices=choices, overrides=overrides)
    if outcome.failed and hydra_cfg.mode == RunMode.RUN:
        raise outcome.error
    return outcome.summary["status"]


if __name__ == "__main__":
    main()
