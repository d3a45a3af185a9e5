"""The calibration suite's plan (conf/calibration/suite.yaml) spans every term of the cost model.

The plan is not run here: each of its runs is replayed in the simulator, whose schedulers and
caches are the real code, so the replayed steps are the batches the real runs schedule (exactly
for the closed-loop bursts; the shared-prefix run's arrivals depend on the clock, its shared
blocks do not). The steps must reach every regime the plan claims, and every run the regimes
its ``covers`` names.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from engine.config import CONF_DIR
from experiments.calibration.calibrate import main, step_shapes
from experiments.calibration.replay import replay_steps
from experiments.calibration.suite import load_plan
from simulator.cost_model import FIT_TERMS, CostModel
from simulator.hardware import Hardware
from simulator.model_shapes import hf_config_of, model_config_for_costs

PLAN = load_plan()


@pytest.fixture(scope="module")
def replayed() -> dict[str, pd.DataFrame]:
    steps = {}
    for run in PLAN.runs:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=PLAN.overrides(run))
        assert cfg.model.name == PLAN.model
        steps[run.name] = replay_steps(cfg)
    return steps


def regimes_of(steps: pd.DataFrame, plan=PLAN) -> set[str]:
    """The regimes a run's steps reach."""
    decode_only = steps[steps.num_prefill_tokens == 0]
    mixed = steps[(steps.num_prefill_tokens > 0) & (steps.num_decode_tokens > 0)]
    found = set()
    if len(set(decode_only.num_seqs)) >= 2:
        found.add("decode_batches")
    if ((steps.num_prefill_tokens > 0) & (steps.num_decode_tokens == 0)).any():
        found.add("whole_prompts")
    if (steps.context_tokens / steps.num_seqs).max() >= plan.max_context_len:
        found.add("long_context")
    if len(mixed) >= 5 and len(set(mixed.num_prefill_tokens)) >= 3:
        found.add("prefill_chunks")
    if (steps.shared_context_tokens > 0).any():
        found.add("shared_prefix")
    if steps.num_preempted.sum() > 0:
        found.add("preemption")
    return found


def test_every_run_reaches_what_it_covers(replayed):
    for run in PLAN.runs:
        missing = set(run.covers) - regimes_of(replayed[run.name])
        assert not missing, f"suite run {run.name} does not reach {missing}"


def test_the_plan_spans_decode_batches_contexts_chunks_sharing_and_preemption(replayed):
    steps = pd.concat(replayed.values())
    decode_sizes = set(steps[steps.num_prefill_tokens == 0].num_seqs)
    assert {1, PLAN.max_num_seqs} <= decode_sizes  # both ends of the decode batches
    assert len(decode_sizes & set(range(1, PLAN.max_num_seqs + 1))) >= 0.85 * PLAN.max_num_seqs  # and most between
    chunk_budgets = {int(o.partition("=")[2]) for run in PLAN.runs for o in run.overrides
                     if o.startswith("scheduler.max_num_batched_tokens=")}
    assert len(chunk_budgets) >= 2
    assert regimes_of(steps) >= {"decode_batches", "whole_prompts", "long_context", "prefill_chunks",
                                 "shared_prefix", "preemption"}


def test_every_cost_model_term_is_exercised_and_separable(replayed):
    """Every term of the fit is non-zero on some step, and the terms other than the weight read
    (constant on one model; told apart from the step overhead only by the roofline's regimes) are
    linearly independent over the plan's steps: the fit can tell each one from the rest."""
    cfg_model = model_config_for_costs(hf_config_of(_model_spec())[0])
    units = Hardware(name="units", peak_tflops=0.15, bandwidth_tbps=0.025, dtype_bytes=4, attention_pairs="padded",
                     small_batch_rows=128, small_batch_tile_rows=8, large_batch_row_buckets=4)
    model = CostModel(units, cfg_model)
    x = np.array([model.terms(shape).fit_row() for steps in replayed.values() for shape in step_shapes(steps)])
    assert (np.abs(x) > 0).any(axis=0).all(), [t for t, used in zip(FIT_TERMS, (x != 0).any(axis=0)) if not used]
    separable = [i for i, term in enumerate(FIT_TERMS) if term != "weight_time_scale"]
    scaled = x[:, separable] / np.linalg.norm(x[:, separable], axis=0)
    assert np.linalg.matrix_rank(scaled, tol=1e-6) == len(separable)


def test_suite_and_run_folders_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        main(["--name", "x"])
    with pytest.raises(SystemExit):
        main(["--suite", "some/run", "--name", "x"])
    assert "give run folders or --suite" in capsys.readouterr().err


def _model_spec() -> dict:
    import yaml

    return yaml.safe_load((CONF_DIR / "model" / f"{PLAN.model}.yaml").read_text())
