"""The calibration suite: a fixed plan of short real runs that spans the cost model's terms.

    python -m experiments.calibration.calibrate --suite --name NAME

A fit of whole steps holds where its steps were (:mod:`simulator.feature_ranges`): one ordinary
run of one's own leaves out long contexts, chunked prefill, shared prefix blocks and preemption,
and the fit then puts their cost on whichever term happens to correlate. The suite is the plan
``conf/calibration/suite.yaml``: a handful of short runs, each there for a regime (its
``covers``), which together reach decode batches of 1 to ``max_num_seqs``, contexts up to
``max_context_len`` tokens, prefill chunks of several sizes, steps that share prefix blocks and
preemption. :func:`run_plan` runs them with the real engine (``python run.py`` per run, with the
plan's environment), printing progress, and hands the folders to the fit.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from engine.config import CONF_DIR

SUITE_FILE = CONF_DIR / "calibration" / "suite.yaml"
REPO = CONF_DIR.parent
RUNS_DIR = REPO / "results" / "runs"
#: what a run of the plan may be there for (``covers``); tests/test_calibration_suite.py checks each
REGIMES = ("decode_batches", "whole_prompts", "long_context", "prefill_chunks", "shared_prefix", "preemption")


@dataclass(frozen=True)
class SuiteRun:
    name: str
    covers: tuple[str, ...]
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class SuitePlan:
    """``conf/calibration/suite.yaml``, read and checked."""

    model: str
    env: dict[str, str]
    common: tuple[str, ...]
    max_num_seqs: int
    max_context_len: int
    runs: tuple[SuiteRun, ...]

    def overrides(self, run: SuiteRun) -> list[str]:
        """The Hydra overrides of one run (the plan's common ones, then its own)."""
        return [*self.common, *run.overrides]


def load_plan(path: Path = SUITE_FILE) -> SuitePlan:
    """Read a suite plan; ``ValueError`` naming the file and field if it is malformed."""
    raw = yaml.safe_load(Path(path).read_text())
    try:
        runs = tuple(SuiteRun(str(r["name"]), tuple(r["covers"]), tuple(str(o) for o in r["overrides"]))
                     for r in raw["runs"])
        plan = SuitePlan(str(raw["model"]), {str(k): str(v) for k, v in (raw.get("env") or {}).items()},
                         tuple(raw.get("common") or ()), int(raw["max_num_seqs"]), int(raw["max_context_len"]), runs)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path}: a suite plan needs model, max_num_seqs, max_context_len and runs of "
                         f"name / covers / overrides ({error!r})") from error
    for run in plan.runs:
        unknown = [c for c in run.covers if c not in REGIMES]
        if unknown:
            raise ValueError(f"{path}: run {run.name!r} covers unknown regimes {unknown}; known: {list(REGIMES)}")
    names = [run.name for run in plan.runs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: run names must be unique, got {names}")
    return plan


def suite_dir(name: str) -> Path:
    """Where the suite of calibration ``name`` keeps its runs."""
    return RUNS_DIR / f"calibration_suite-{name}"


def run_plan(plan: SuitePlan, out: Path, python: str = sys.executable) -> list[Path]:
    """Run every run of ``plan`` with the real engine into ``out/<run name>``, printing progress;
    returns the run folders. ``ValueError`` if ``out`` exists (no run is overwritten) or a run fails."""
    if out.exists():
        raise ValueError(f"{out} exists: pick another --name (the suite never overwrites runs)")
    env = {**os.environ, **plan.env}
    folders = []
    started = time.perf_counter()
    for index, run in enumerate(plan.runs, 1):
        folder = out / run.name
        print(f"[{index}/{len(plan.runs)}] {run.name} ({', '.join(run.covers)}): python run.py "
              f"{' '.join(plan.overrides(run))}", flush=True)
        run_start = time.perf_counter()
        done = subprocess.run([python, str(REPO / "run.py"), *plan.overrides(run), f"hydra.run.dir={folder}"],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise ValueError(f"suite run {run.name} failed (exit {done.returncode}); its folder: {folder}\n"
                             f"{done.stderr[-2000:]}")
        print(f"    done in {time.perf_counter() - run_start:.0f} s ({time.perf_counter() - started:.0f} s so far)",
              flush=True)
        folders.append(folder)
    return folders
