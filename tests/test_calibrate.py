"""``python -m experiments.calibrate``: fits real runs' steps.csv into a usable hardware file, or
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
from experiments.calibrate import main
from simulator.cost_model import CostModel
from simulator.hardware import Hardware
from simulator.model_shapes import model_config_for_costs

TINY_SPEC = yaml.safe_load((CONF_DIR / "model" / "tiny.yaml").read_text())
TRUTH = dict(step_overhead_s=0.02, seq_overhead_s=0.003, linear_time_scale=0.5, small_batch_time_scale=0.7,
             kv_time_scale=4.0, attention_time_scale=9.0, tile_tail_time_scale=0.6)


def fake_run(folder: Path, num_steps: int, seed: int = 0, durations: str = "model", skinny_rows: int | None = 24) -> Path:
    """A run folder whose step durations follow the cost model with known coefficients
    (``durations="noisy"``: within -25% / +40% of it; ``"random"``: unrelated to the steps), made
    with ``attention=auto`` that built cpu_paged and (unless ``skinny_rows`` is None, as in runs
    made before it was recorded) a skinny GEMM of ``skinny_rows`` rows."""
    rng = np.random.default_rng(seed)
    truth = Hardware(name="truth", peak_tflops=0.15, bandwidth_tbps=0.025, dtype_bytes=4, weight_time_scale=0.0,
                     small_batch_rows=24, small_batch_tile_rows=8, **TRUTH)
    model = CostModel(truth, model_config_for_costs(TINY_SPEC["hf_config"]))
    rows, clock = [], 0.0
    for step in range(num_steps):
        seqs = int(rng.integers(1, 16))
        prefill = int(rng.integers(20, 300)) if rng.random() < 0.3 else 0
        context = seqs * int(rng.integers(16, 200)) + prefill
        shape = StepShape(num_seqs=seqs, num_rows=seqs + prefill, num_decode_tokens=seqs, num_wasted_slots=0,
                          num_sampled=seqs, context_tokens=context, prefill_attention_pairs=prefill * (prefill + 1) // 2)
        duration = {"model": model.step_time(shape), "random": float(rng.uniform(0.01, 1.0)),
                    "noisy": model.step_time(shape) * float(rng.uniform(0.75, 1.4))}[durations]
        rows.append(dict(step=step, start_time=clock, end_time=clock + duration, duration_s=duration, num_seqs=seqs,
                         num_prefill_tokens=prefill, num_decode_tokens=seqs, num_wasted_slots=0, num_sampled=seqs,
                         context_tokens=context, prefill_attention_pairs=shape.prefill_attention_pairs))
        clock += duration
    folder.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "steps.csv", index=False)
    auto = {"_target_": "strategies.attention.auto.select_attention_backend", "device": "cpu", "dtype": "float32"}
    OmegaConf.save(OmegaConf.create({"model": TINY_SPEC, "dtype": "float32", "device": "cpu",
                                     "attention": auto, "engine": {"prepack": "auto"}}),
                   folder / "config.yaml")
    environment = {} if skinny_rows is None else {"skinny_gemm_max_rows": skinny_rows, "skinny_gemm_tile_rows": 8}
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
    assert hardware.small_batch_tile_rows == 8
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
                 "--small-batch-tile-rows", "8"]) == 0
    assert instantiate(OmegaConf.load(tmp_path / "hw" / "old.yaml")).tile_tail_time_scale == pytest.approx(0.6, rel=1e-3)
    wider = fake_run(tmp_path / "wider", 120, seed=1, skinny_rows=128)
    assert main([str(fake_run(tmp_path / "new", 120)), str(wider), "--name", "mixed", "--out-dir", str(tmp_path / "hw")]) == 2
    assert "one engine build at a time" in capsys.readouterr().err
