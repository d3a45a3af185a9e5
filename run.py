"""servelab's entry point: compose a config, build an engine, drive a workload, write results.

    python run.py                                    # default: SmolLM2-135M (random weights), burst c=8
    python run.py cache=paged scheduler=static       # one configuration
    python run.py -m scheduler=static,continuous workload.concurrency=1,8,32
    python run.py +experiment=naive_vs_continuous    # a headline result (conf/experiment/)
    python -m experiments.results.report results/sweeps/<dir>

Results land in the Hydra output folder (results/runs/<time>/ or results/sweeps/<time>/<job>/):
config.yaml (resolved), requests.csv, steps.csv, summary.json, summary.md and PNG plots.
A failed single run exits nonzero; in a multirun a failed job is recorded and the sweep continues.
"""
from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from experiments.harness.job import execute


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> str:
    hydra_cfg = HydraConfig.get()
    outcome = execute(
        cfg,
        Path(hydra_cfg.runtime.output_dir),
        choices=dict(hydra_cfg.runtime.choices),
        overrides=list(hydra_cfg.overrides.task),
    )
    if outcome.failed and hydra_cfg.mode == RunMode.RUN:
        raise outcome.error
    return outcome.summary["status"]


if __name__ == "__main__":
    main()
