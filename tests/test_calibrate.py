"""``python -m experiments.calibration.calibrate``: fits real runs' steps.csv into a usable hardware file, or
says why not and writes nothing."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf

from engine.config import CONF_DIR
from engine.step_shape import StepShape
from experiments.calibration.calibrate import main
from simulator.cost_model import CostModel
from simulator.hardware import Hardware
from simulator.model_shapes import model_config_for_costs

TINY_SPEC = yaml.safe_load((CONF_DIR / "model" / "tiny.yaml").read_text())
TRUTH = dict(step_overhead_s=0.02, seq_overhead_s=0.003, linear_time_scale=0.5, small_batch_time_scale=0.7,
             kv_time_scale=4.0, attention_time_scale=9.0, tile_tail_time_scale=0.6, shared_kv_time_scale=2.5)


def fake_run(folder: Path, num_steps: int, seed: int = 0, durations: str = "model", skinny_rows: int | None = 24,
             shared_prefix: bool = True) -> Path:
    """A run folder whose step durations follow the cost model with known coefficients
    (``durations="noisy"``: within -25% / +40% of it; ``"random"``: unrelated to the steps), made
    with ``attention=auto`` that built cpu_paged and (unless ``skinny_rows`` is None, as in runs
    made before it was recorded) a skinny GEMM of ``skinny_rows`` rows in tiles of 8 and oneDNN
    above it (4 row buckets per octave); with ``shared_prefix``, some decode steps share KV blocks."""
    rng, prefix_rng = np.random.default_rng(seed), np.random.default_rng(seed + 100)
    truth = Hardware(name="truth", peak_tflops=0.15, bandwidth_tbps=0.025, dtype_bytes=4, weight_time_scale=0.0,
                     small_batch_rows=24, small_batch_tile_rows=8, large_batch_row_buckets=4, **TRUTH)
    model = CostModel(truth, model_config_for_costs(TINY_SPEC["hf_config"]))
    rows, clock = [], 0.0
    for step in range(num_steps):
        seqs = int(rng.integers(1, 16))
        prefill = int(rng.integers(20, 300)) if rng.random() < 0.3 else 0
        shared = (seqs - 1) * 64 * int(prefix_rng.integers(1, 8)) if shared_prefix and prefix_rng.random() < 0.3 else 0
        context = seqs * int(rng.integers(16, 200)) + prefill + shared
        shape = StepShape(num_seqs=seqs, num_rows=seqs + prefill, num_decode_tokens=seqs, num_wasted_slots=0,
                          num_sampled=seqs, context_tokens=context, prefill_attention_pairs=prefill * (prefill + 1) // 2,
                          shared_context_tokens=shared)
        duration = {"model": model.step_time(shape), "random": float(rng.uniform(0.01, 1.0)),
                    "noisy": model.step_time(shape) * float(rng.uniform(0.75, 1.4))}[durations]
        rows.append(dict(step=step, start_time=clock, end_time=clock + duration, duration_s=duration, num_seqs=seqs,
                         num_prefill_tokens=prefill, num_decode_tokens=seqs, num_wasted_slots=0, num_sampled=seqs,
                         context_tokens=context, prefill_attention_pairs=shape.prefill_attention_pairs,
                         shared_context_tokens=shared))
        clock += duration
    folder.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "steps.csv", index=False)
    auto = {"_target_": "strategies.attention.auto.select_attention_backend", "device": "cpu", "dtype": "float32"}
    OmegaConf.save(OmegaConf.create({"model": TINY_SPEC, "dtype": "float32", "device": "cpu",
                                     "attention": auto, "engine": {"prepack": "auto"}}),
                   folder / "config.yaml")
    environment = {} if skinny_rows is None else {"skinny_gemm_max_rows": skinny_rows, "skinny_gemm_tile_rows": 8,
                                                  "onednn_row_buckets": 4}
    (folder / "summary.json").write_text(json.dumps({"run": {"attention": "auto", "attention_backend": "cpu_paged"},
                                                     "environment": environment}))
    return folder


def test_fit_round_trip_writes_a_usable_hardware_file(tmp_path):
    run = fake_run(tmp_path / "run", 120)
    assert main([str(run), "--name", "fitted", "--out-dir", str(tmp_path / "hw")]) == 0
    written = tmp_path / "hw" / "fitted.yaml"
    hardware = instantiate(OmegaConf.load(written))
    assert isinstance(hardware, Hardware) and hardware.calibrated and hardware.calibrated_model == "tiny"
    # what the run built, from its summary.json: attention=auto's cpu_paged (causal pairs), 24-row skinny GEMM
    # in tiles of 8 rows
    assert hardware.attention_pairs == "causal" and hardware.small_batch_rows == 24
    assert hardware.small_batch_tile_rows == 8 and hardware.large_batch_row_buckets == 4
    for name, value in TRUTH.items():
        assert getattr(hardware, name) == pytest.approx(value, rel=1e-3)
    assert "R^2 1.000" in hardware.calibration
    # usable at once: a simulated engine on it
    from simulator import SimulatedLLM

    cfg = OmegaConf.create({"model": TINY_SPEC, "cache": OmegaConf.load(CONF_DIR / "cache" / "paged.yaml"),
                            "scheduler": OmegaConf.load(CONF_DIR / "scheduler" / "continuous.yaml"),
                            "hardware": OmegaConf.load(written), "seed": 0})
    engine = SimulatedLLM.from_config(cfg)
    assert engine.describe()["timing"].startswith("simulated, calibrated (fitted, on tiny)")
    assert main([str(run), "--name", "fitted", "--out-dir", str(tmp_path / "hw")]) == 2  # exists: no silent overwrite


def test_the_hardware_file_records_the_ranges_the_kept_steps_covered(tmp_path):
    """feature_ranges in the written file are the min / max of each feature over the run's steps,
    and loading the file reads them back as the same numbers."""
    from experiments.calibration.calibrate import step_shapes
    from simulator.feature_ranges import FEATURES, step_features

    run = fake_run(tmp_path / "run", 120)
    assert main([str(run), "--name", "fitted", "--out-dir", str(tmp_path / "hw")]) == 0
    hardware = instantiate(OmegaConf.load(tmp_path / "hw" / "fitted.yaml"))
    features = [step_features(shape, "causal") for shape in step_shapes(pd.read_csv(run / "steps.csv"))]
    assert set(hardware.feature_ranges) == set(FEATURES)
    for name, covered in hardware.feature_ranges.items():
        values = [f[name] for f in features]
        assert covered.low == pytest.approx(min(values), rel=1e-5)
        assert covered.high == pytest.approx(max(values), rel=1e-5)
    assert hardware.feature_ranges["batch_rows"].high > hardware.feature_ranges["batch_rows"].low  # not a constant


@pytest.mark.parametrize("case", ["too_few_steps", "uncorrelated", "noisy", "not_a_run", "peer_steps", "auto_unknown"])
def test_refuses_and_writes_nothing(tmp_path, case, capsys):
    if case == "too_few_steps":
        run = fake_run(tmp_path / "run", 12)
    elif case == "uncorrelated":
        run = fake_run(tmp_path / "run", 120, durations="random")
    elif case == "noisy":
        run = fake_run(tmp_path / "run", 120, durations="noisy")
    elif case == "not_a_run":
        run = tmp_path / "empty"
        run.mkdir()
    elif case == "auto_unknown":  # attention=auto, and no summary.json saying what it built
        run = fake_run(tmp_path / "run", 120)
        (run / "summary.json").unlink()
    else:  # an HF peer's steps.csv has no step shape
        run = fake_run(tmp_path / "run", 120)
        pd.read_csv(run / "steps.csv").drop(columns=["context_tokens"]).to_csv(run / "steps.csv", index=False)
    assert main([str(run), "--name", "nope", "--out-dir", str(tmp_path / "hw")]) != 0
    assert not (tmp_path / "hw" / "nope.yaml").exists()
    message = capsys.readouterr().err
    expected = {"too_few_steps": "too few steps", "uncorrelated": "steps fit the model within",
                "noisy": "explains too little",
                "not_a_run": "not a run folder", "peer_steps": "lacks ['context_tokens']",
                "auto_unknown": "attention=auto"}[case]
    assert expected in message


def test_skinny_limit_comes_from_the_runs_or_from_the_option(tmp_path, capsys):
    """A run that does not record its skinny GEMM limit and tile needs --small-batch-rows and
    --small-batch-tile-rows; runs of different limits are not mixed in one fit."""
    old = fake_run(tmp_path / "old", 120, skinny_rows=None)
    assert main([str(old), "--name", "old", "--out-dir", str(tmp_path / "hw")]) == 2
    assert "--small-batch-rows" in capsys.readouterr().err and not (tmp_path / "hw" / "old.yaml").exists()
    assert main([str(old), "--name", "old", "--out-dir", str(tmp_path / "hw"), "--small-batch-rows", "24"]) == 2
    assert "--small-batch-tile-rows" in capsys.readouterr().err and not (tmp_path / "hw" / "old.yaml").exists()
    assert main([str(old), "--name", "old", "--out-dir", str(tmp_path / "hw"), "--small-batch-rows", "24",
                 "--small-batch-tile-rows", "8"]) == 2
    assert "--large-batch-row-buckets" in capsys.readouterr().err and not (tmp_path / "hw" / "old.yaml").exists()
    assert main([str(old), "--name", "old", "--out-dir", str(tmp_path / "hw"), "--small-batch-rows", "24",
                 "--small-batch-tile-rows", "8", "--large-batch-row-buckets", "4"]) == 0
    assert instantiate(OmegaConf.load(tmp_path / "hw" / "old.yaml")).tile_tail_time_scale == pytest.approx(0.6, rel=1e-3)
    wider = fake_run(tmp_path / "wider", 120, seed=1, skinny_rows=128)
    assert main([str(fake_run(tmp_path / "new", 120)), str(wider), "--name", "mixed", "--out-dir", str(tmp_path / "hw")]) == 2
    assert "one engine build at a time" in capsys.readouterr().err


def test_shared_kv_is_fitted_only_where_the_runs_shared_blocks(tmp_path, capsys):
    """Runs without shared KV blocks cannot tell what a shared block costs: the file says so
    (null: priced as kv_time_scale) instead of writing a fitted 0; a prefix-cache run that did
    not record the shared context is refused."""
    run = fake_run(tmp_path / "run", 120, shared_prefix=False)
    assert main([str(run), "--name", "unshared", "--out-dir", str(tmp_path / "hw")]) == 0
    hardware = instantiate(OmegaConf.load(tmp_path / "hw" / "unshared.yaml"))
    assert hardware.shared_kv_time_scale is None and hardware.shared_kv_scale == hardware.kv_time_scale
    prefix = fake_run(tmp_path / "prefix", 120)
    config = OmegaConf.load(prefix / "config.yaml")
    config.cache = OmegaConf.load(CONF_DIR / "cache" / "prefix.yaml")
    OmegaConf.save(config, prefix / "config.yaml")
    pd.read_csv(prefix / "steps.csv").drop(columns=["shared_context_tokens"]).to_csv(prefix / "steps.csv", index=False)
    assert main([str(prefix), "--name", "old-prefix", "--out-dir", str(tmp_path / "hw")]) == 2
    assert "lacks shared_context_tokens" in capsys.readouterr().err
