"""The peer benchmark's table: medians over interleaved repeats, ratios of medians to servelab over HTTP,
engines that could not run kept with their reason, targets checked; and the whole experiment on tiny."""
from __future__ import annotations

import pandas as pd
import pytest

from experiments.peers.table import peer_table, target_checks


def run(serving: str, concurrency: int, tok_s: float, ttft_p50: float, status: str = "ok", error: str | None = None) -> dict:
    return {"status": status, "error": error, "engine": serving.split("_")[0], "override:serving": serving,
            "concurrency": concurrency, "output_throughput": tok_s, "ttft_s_p50": ttft_p50, "ttft_s_p99": 2 * ttft_p50,
            "tpot_s_p50": ttft_p50 / 10}


NO_CMAKE = "LlamaCppUnavailable: building llama-server needs cmake (e.g. `apt-get install cmake`)\nTraceback..."


def test_medians_over_repeats_ratios_of_medians_and_engines_not_run():
    frame = pd.DataFrame([
        run("hf_continuous", 8, 30.0, 4.0), run("servelab_http", 8, 100.0, 1.0), run("servelab", 8, 120.0, 0.5),
        run("llamacpp_f32", 8, 0.0, 0.0, "failed", NO_CMAKE),
        run("hf_continuous", 8, 40.0, 2.0), run("servelab_http", 8, 130.0, 3.0), run("servelab", 8, 110.0, 0.5),
        run("llamacpp_f32", 8, 0.0, 0.0, "failed", NO_CMAKE),
        run("hf_continuous", 8, 60.0, 3.0), run("servelab_http", 8, 90.0, 2.0), run("servelab", 8, 100.0, 0.5),
        run("llamacpp_f32", 8, 0.0, 0.0, "failed", NO_CMAKE),
        run("servelab_http", 32, 200.0, 5.0), run("hf_continuous", 32, 50.0, 10.0),
        run("hf_continuous", 32, 0.0, 0.0, "failed", "RuntimeError: out of memory"),
    ])
    table = peer_table(frame)
    assert list(table[table.concurrency == 8].engine) == ["servelab_http", "hf_continuous", "servelab", "llamacpp_f32"]
    ours = table[(table.concurrency == 8) & (table.engine == "servelab_http")].iloc[0]
    assert ours["runs"] == 3 and ours["output tok/s"] == 100.0 and ours["TTFT p50 (s)"] == 2.0
    assert ours["TPOT p50 (s)"] == pytest.approx(0.2) and ours["tok/s range"] == "90.0-130.0"
    peer = table[(table.concurrency == 8) & (table.engine == "hf_continuous")].iloc[0]
    assert peer["output tok/s"] == 40.0  # median of 30, 40, 60
    assert peer["servelab_http / this tok/s"] == pytest.approx(100.0 / 40.0)
    assert peer["servelab_http / this TTFT p50"] == pytest.approx(2.0 / 3.0)
    in_process = table[(table.concurrency == 8) & (table.engine == "servelab")].iloc[0]
    assert in_process["servelab_http / this tok/s"] == pytest.approx(100.0 / 110.0)
    not_run = table[(table.concurrency == 8) & (table.engine == "llamacpp_f32")].iloc[0]
    assert not_run["runs"] == 0 and pd.isna(not_run["output tok/s"])
    assert not_run["failed"] == "not run: LlamaCppUnavailable: building llama-server needs cmake (e.g. `apt-get install cmake`)"
    partly = table[(table.concurrency == 32) & (table.engine == "hf_continuous")].iloc[0]
    assert partly["runs"] == 1 and partly["failed"] == "1 of 2: RuntimeError: out of memory"
    assert partly["servelab_http / this tok/s"] == pytest.approx(4.0)

    checks = target_checks(table, [
        {"concurrency": 32, "peer": "hf_continuous", "ratio": "servelab_http / this tok/s", "at_least": 3.0},
        {"concurrency": 8, "peer": "hf_continuous", "ratio": "servelab_http / this tok/s", "at_least": 3.0},
        {"concurrency": 8, "peer": "hf_continuous", "ratio": "servelab_http / this TTFT p50", "at_most": 1.0},
        {"concurrency": 8, "peer": "llamacpp_f32", "ratio": "servelab_http / this tok/s", "at_least": 1.4},
    ])
    assert list(checks.result) == ["met", "NOT met", "met", "not measured"]
    assert checks.measured.iloc[0] == pytest.approx(4.0) and checks.target.iloc[2] == "<= 1.0"


def test_peer_benchmark_quick_check_on_tiny_runs_end_to_end(tmp_path):
    from tests.test_run_e2e import run_py

    sweep = tmp_path / "sweep"
    proc = run_py(["+experiment=peer_benchmark", "model=tiny", "+repeat=0", "workload.concurrency=2",
                   "+serving=servelab_http,llamacpp_f32,hf_static", "workload.max_max_tokens=8", "workload.max_prompt_len=32",
                   "plots=false", "driver.progress=false", f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_csv(sweep / "peer_table.csv")
    assert list(table.engine) == ["servelab_http", "llamacpp_f32", "hf_static"] and list(table.runs) == [1, 0, 1]
    assert table.set_index("engine").at["llamacpp_f32", "failed"].startswith(
        "not run: ValueError: engine=llamacpp serves a GGUF file, and model 'tiny' has none")
    assert table.set_index("engine").at["hf_static", "servelab_http / this tok/s"] > 0
    targets = pd.read_csv(sweep / "peer_targets.csv")
    assert len(targets) == 11 and set(targets.result) == {"not measured"}  # no c = 1, 8, 32 here
    assert "not run: ValueError" in proc.stdout
