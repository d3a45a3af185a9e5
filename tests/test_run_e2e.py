"""run.py end to end on the tiny model: result files, multirun + report, failures, peer parity."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from experiments.harness.driver import drive
from experiments.harness.metrics import SLO
from experiments.results.files import REQUEST_COLUMNS, STEP_COLUMNS, requests_frame
from experiments.harness.workloads import special_token_ids

ROOT = Path(__file__).resolve().parents[1]
TINY_BURST = ["model=tiny", "workload=burst", "workload.concurrency=2", "workload.max_max_tokens=12",
              "workload.max_prompt_len=40", "driver.progress=false"]


def run_py(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_single_run_writes_every_file(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_py([*TINY_BURST, f"hydra.run.dir={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("config.yaml", "requests.csv", "steps.csv", "summary.json", "summary.md",
                 "kv_usage.png", "batch.png", "ttft.png", "report.html"):  # report.html: RunPageCallback
        assert (out / name).is_file(), name
    requests = pd.read_csv(out / "requests.csv")
    assert list(requests.columns) == REQUEST_COLUMNS and len(requests) == 4
    assert list(pd.read_csv(out / "steps.csv").columns) == STEP_COLUMNS
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["run"]["engine"] == "servelab" and summary["run"]["concurrency"] == 2
    # the default attention=auto resolves to the fast CPU float32 backend, and the run says which
    assert summary["run"]["attention"] == "auto" and summary["run"]["attention_backend"] == "cpu_paged"
    assert summary["environment"]["attention_backend"] == "cpu_paged"
    assert summary["metrics"]["num_requests"] == 4
    assert summary["metrics"]["total_output_tokens"] == requests["output_tokens"].sum()
    assert "| output tok/s |" in proc.stdout


def test_failed_single_run_exits_nonzero_and_records_it(tmp_path: Path) -> None:
    out = tmp_path / "fail"
    proc = run_py(["model=tiny", "workload=four_prompts", "workload.long_max_tokens=600",  # > tiny max_model_len
                   "driver.progress=false", f"hydra.run.dir={out}"])
    assert proc.returncode != 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "ValueError" in summary["error"]


def test_multirun_report_naive_vs_continuous_and_failed_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_py(["-m", "+experiment=naive_vs_continuous", "model=tiny", "driver.progress=false",
                   "workload.long_max_tokens=50,600", f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = subprocess.run([sys.executable, "-m", "experiments.results.report", str(sweep)], cwd=ROOT, capture_output=True,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    table = pd.read_csv(sweep / "report.csv")
    assert (sweep / "report.md").is_file() and (sweep / "ttft_cdf.png").is_file() and (sweep / "kv_usage.png").is_file()
    assert len(table) == 4
    failed = table[table["status"] == "failed"]
    assert len(failed) == 2 and (failed["override:workload.long_max_tokens"].astype(str) == "600").all()
    ok = table[table["status"] == "ok"].set_index("scheduler")
    assert ok.loc["static", "wasted_slots"] == 3 * (50 - 5)
    assert ok.loc["continuous", "wasted_slots"] == 0
    assert {"engine", "cache", "scheduler", "attention", "concurrency", "block_size", "status"} <= set(table.columns)


def test_greedy_tokens_identical_servelab_and_hf_static() -> None:
    """Token identity holds in float32: servelab as engine=servelab_f32 (the default computes in
    bfloat16 where the CPU has it)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfgs = {name: compose("config", overrides=[*TINY_BURST, f"engine={engine}", "device=cpu"])
                for name, engine in (("servelab", "servelab_f32"), ("hf_static", "hf_static"))}
    tokens, tables = {}, {}
    for name, cfg in cfgs.items():
        engine = instantiate(cfg.engine)(cfg)
        mc = engine.model_config
        requests = instantiate(cfg.workload, vocab_size=mc.vocab_size, special_token_ids=special_token_ids(mc))
        result = drive(engine, requests, cfg.driver.max_concurrency, progress=False)
        tokens[name] = {r.request_id: r.output_token_ids for r in result.records}
        tables[name] = requests_frame(result.records, SLO())
    assert len(tokens["servelab"]) == 4
    assert tokens["servelab"] == tokens["hf_static"]
    # hf_static is streamed: its first token comes at the prefill step, before the finish, and
    # every token has its own time (one per decoding step of the batch)
    static = tables["hf_static"]
    assert (static["output_tokens"] > 1).all()
    assert (static["ttft_s"] < static["e2e_s"]).all() and (static["tpot_s"] > 0).all() and (static["itl_mean_s"] > 0).all()
    # the driver held half the burst behind the client cap: their wait is client queue, not TTFT
    assert (static["client_queue_s"] > 0).sum() == 2 and (static["e2e_including_client_queue_s"] >= static["e2e_s"]).all()


@pytest.mark.slow
def test_hf_continuous_matches_too() -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY_BURST, "engine=hf_continuous", "device=cpu"])
    engine = instantiate(cfg.engine)(cfg)
    try:
        mc = engine.model_config
        requests = instantiate(cfg.workload, vocab_size=mc.vocab_size, special_token_ids=special_token_ids(mc))
        result = drive(engine, requests, cfg.driver.max_concurrency, progress=False)
    finally:
        engine.close()
    assert [r.output_tokens for r in result.records] == [r.sampling_params.max_tokens for r in requests]


def test_chat_workload_servelab_and_hf_static_same_answers(tmp_path: Path, byte_text_ckpt: Path) -> None:
    """workload=chat through the chat template on a model with a tokenizer: requests.csv holds
    prompt and output text, summary.md shows sample answers, the HF peer gives the same text
    (servelab in float32, engine=servelab_f32: the identity holds for that dtype)."""
    from experiments.harness.chat_prompts import prompt_bank
    from experiments.harness.job import execute

    overrides = ["model=tiny", f"model.path={byte_text_ckpt}", "model.weights=pretrained", "workload=chat",
                 "workload.num_requests=3", "workload.max_tokens=12", "workload.concurrency=2",
                 "driver.progress=false", "device=cpu", "plots=false"]
    tables = {}
    for engine, config in (("servelab", "servelab_f32"), ("hf_static", "hf_static")):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[*overrides, f"engine={config}"])
        outcome = execute(cfg, tmp_path / engine, {"engine": engine, "workload": "chat"}, overrides)
        assert not outcome.failed, outcome.summary.get("traceback")
        tables[engine] = pd.read_csv(tmp_path / engine / "requests.csv", keep_default_na=False)
        assert "## Sample answers" in (tmp_path / engine / "summary.md").read_text()
    servelab = tables["servelab"]
    assert list(servelab.columns) == REQUEST_COLUMNS and len(servelab) == 3
    assert set(servelab["prompt_text"]) <= set(prompt_bank())
    assert (servelab["output_text"].str.len() > 0).all()
    assert (servelab["prompt_tokens"] > servelab["prompt_text"].str.len()).all()  # rendered: template + bytes
    for column in ("output_token_ids", "output_text", "prompt_text", "finish_reason"):
        assert list(servelab[column]) == list(tables["hf_static"][column]), column
