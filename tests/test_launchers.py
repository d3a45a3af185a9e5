"""A sweep through Hydra's submitit launcher (``submitit_local``: the stand-in for SLURM).

``hydra/launcher=submitit_slurm`` submits each job of a multirun to a cluster; ``submitit_local``
runs the very same launcher code with local subprocesses, so this test shows that the documented
cluster path works end to end: the jobs run in their own processes, write their result files,
and the report callback sees them. The jobs are simulated (no model to load), so it is quick.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # two job processes that each import torch + Hydra: ~20 s alone, over a minute on a busy 2-core machine
def test_submitit_local_sweep_runs_every_job(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "run.py", "-m", "hydra/launcher=submitit_local", "engine=simulated", "hardware=h100",
         "model=tiny", "workload=burst", "workload.concurrency=2,4", "driver.progress=false", "plots=false",
         f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=5"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 2
    runs = [json.loads(path.read_text()) for path in summaries]
    assert all(run["status"] == "ok" for run in runs)
    assert sorted(run["run"]["concurrency"] for run in runs) == [2, 4]
    assert sorted(run["metrics"]["num_requests"] for run in runs) == [4, 8]  # burst: 2 x concurrency
    assert (sweep / ".submitit").is_dir()  # the jobs went through submitit
