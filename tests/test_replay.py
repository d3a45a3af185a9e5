"""Stored runs reused without the real engine: a checked replay recovers step-shape columns a run
did not record, and ``experiments.calibration.validation --real-from`` re-simulates stored real jobs."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from engine.config import CONF_DIR
from experiments.calibration.calibrate import load_run
from experiments.harness.job import execute
from experiments.calibration.replay import recovered_shapes
from experiments.calibration.validation import resimulate

REAL = ["model=tiny", "device=cpu", "driver.progress=false", "plots=false", "engine=servelab"]


def real_job(folder: Path, overrides: list[str]) -> Path:
    """A stored real run, as a sweep job folder (its .hydra/overrides.yaml included)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    OmegaConf.set_struct(cfg, False)
    del cfg["hydra"]
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    assert not execute(cfg, folder, choices=choices, overrides=overrides).failed
    return folder


@pytest.fixture(scope="module")
def burst_run(tmp_path_factory) -> Path:
    """A burst run of a gather backend (torch_sdpa: it computes the padded pairs)."""
    overrides = [*REAL, "attention=torch_sdpa", "workload=burst", "workload.concurrency=3", "workload.max_prompt_len=40",
                 "workload.max_max_tokens=10"]
    return real_job(tmp_path_factory.mktemp("runs") / "burst", overrides)


def test_replay_recovers_the_padded_pairs_a_run_did_not_record(burst_run, tmp_path):
    steps = pd.read_csv(burst_run / "steps.csv")
    assert steps.padded_attention_pairs.gt(steps.prefill_attention_pairs).any()  # ragged prompts: padding exists
    recovered = recovered_shapes(burst_run, steps.drop(columns="padded_attention_pairs"))
    assert recovered.padded_attention_pairs.tolist() == steps.padded_attention_pairs.tolist()
    # calibration reads such a run through the replay (torch_sdpa computes padded pairs)
    old = tmp_path / "old_run"
    old.mkdir()
    (old / "config.yaml").write_text((burst_run / "config.yaml").read_text())
    steps.drop(columns="padded_attention_pairs").to_csv(old / "steps.csv", index=False)
    _, loaded = load_run(old)
    assert loaded.padded_attention_pairs.tolist() == steps.padded_attention_pairs.tolist()


def test_replay_refuses_when_the_batches_differ(burst_run):
    steps = pd.read_csv(burst_run / "steps.csv").drop(columns="padded_attention_pairs")
    steps.loc[3, "num_decode_tokens"] += 1  # as if the run's timing had changed one batch
    with pytest.raises(ValueError, match="num_decode_tokens differs from the run's at step"):
        recovered_shapes(burst_run, steps)


def test_real_from_resimulates_stored_real_jobs_without_the_engine(tmp_path):
    sweep = tmp_path / "sweep"
    case = "continuous_burst_c4"
    real_job(sweep / "0", [*REAL, f"+validation_case={case}", "workload.max_prompt_len=40",
                           "workload.max_max_tokens=10"])
    written = resimulate(sweep, tmp_path / "out", hardware="cpu-1thread")
    table = pd.read_csv(written[0])
    assert set(table.configuration) == {case}
    real = pd.read_csv(tmp_path / "out" / "real" / "0" / "requests.csv")
    simulated = pd.read_csv(tmp_path / "out" / "simulated" / "0" / "requests.csv")
    assert real.prompt_tokens.tolist() == simulated.prompt_tokens.tolist()  # the same requests
    assert real.output_tokens.tolist() == simulated.output_tokens.tolist()
    ttft = table.set_index("metric").loc["TTFT p50"]
    assert ttft.real == pytest.approx(real.ttft_s.median()) and ttft.simulated == pytest.approx(simulated.ttft_s.median())
    assert ttft.real != ttft.simulated  # the simulated job is new, not a copy of the real one
    summary = yaml.safe_load((tmp_path / "out" / "simulated" / "0" / "summary.json").read_text())
    assert summary["run"]["engine"] == "simulated" and summary["run"]["hardware"] == "cpu-1thread"
