"""The peer benchmark's table: medians over interleaved repeats, ratios of medians to servelab over HTTP,
engines that could not run kept with their reason, targets checked; and the whole experiment on tiny."""
from __future__ import annotations

import pandas as pd
import pytest

from experiments.peers import table as table_module
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
                   "+serving=servelab_http,llamacpp_f32,hf_static", "+peer_shape=random_greedy",
                   "workload.prompt_format=token_ids", "workload.input_len=16", "workload.output_len=4",
                   "plots=false", "driver.progress=false", f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_csv(sweep / "peer_table.csv")
    assert list(table.engine) == ["servelab_http", "llamacpp_f32", "hf_static"] and list(table.runs) == [1, 0, 1]
    assert set(table["shape"]) == {"random_greedy"} and (sweep / "peer_table_random_greedy.md").is_file()
    assert table.set_index("engine").at["llamacpp_f32", "failed"].startswith(
        "not run: ValueError: engine=llamacpp serves a GGUF file, and model 'tiny' has none")
    assert table.set_index("engine").at["hf_static", "servelab_http / this tok/s"] > 0
    targets = pd.read_csv(sweep / "peer_targets.csv")
    assert len(targets) == 11 and set(targets.result) == {"not measured"}  # no c = 1, 8, 32 here
    assert "not run: ValueError" in proc.stdout


SHAPES = ["random_greedy", "random_sampled", "random_long", "chat"]


@pytest.mark.parametrize("experiment_last", [False, True], ids=["experiment-first", "as-the-sweep-orders-them"])
@pytest.mark.parametrize("shape", SHAPES)
def test_each_peer_shape_composes_with_the_experiment_and_the_vllm_presets(shape, experiment_last):
    """+peer_shape=<shape> sets the workload the shape names on top of the experiment, beside a vLLM preset,
    in either order of the overrides (a sweep's job puts ``+experiment`` after the swept ones), and the
    experiment sweeps every shape and the vLLM presets."""
    from hydra import compose, initialize_config_dir

    from engine.config import CONF_DIR

    overrides = [f"+peer_shape={shape}", "workload.concurrency=8", "+serving=vllm_bf16"]
    overrides = overrides + ["+experiment=peer_benchmark"] if experiment_last else ["+experiment=peer_benchmark"] + overrides
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    assert cfg.engine._target_ == "experiments.peers.vllm.VLLMEngine.from_config" and cfg.engine.dtype == "bfloat16"
    swept = cfg.hydra.sweeper.params
    assert swept["+peer_shape"].split(",") == SHAPES
    assert {"vllm_f32", "vllm_bf16", "servelab_http", "servelab_http_f32"} <= set(swept["+serving"].split(","))
    expected = {"random_greedy": (128, 64, 0.0), "random_sampled": (128, 64, 1.0), "random_long": (1024, 128, 0.0)}
    if shape == "chat":
        assert cfg.workload._target_.endswith(".chat") and cfg.workload.ignore_eos is False
    else:
        assert cfg.workload._target_.endswith("random_dataset") and cfg.workload.ignore_eos is True
        assert (cfg.workload.input_len, cfg.workload.output_len, cfg.workload.temperature) == expected[shape]


def test_rows_tables_and_plots_are_per_shape(tmp_path, monkeypatch):
    """Runs of two shapes: servelab_http reads 200 tok/s greedy and 100 sampled, vllm_bf16 50 / 200 at c = 8 / 32
    in both; each shape's rows, ratios, targets, table file and plot come from its own runs only."""
    servelab = {"random_greedy": 200.0, "random_sampled": 100.0}
    frame = pd.DataFrame([{**run(serving, c, tok_s, 1.0), "override:peer_shape": shape}
                          for shape in ("random_greedy", "random_sampled")
                          for c in (8, 32) for serving, tok_s in (("servelab_http", servelab[shape]),
                                                                  ("vllm_bf16", 50.0 * c / 8))])
    table = peer_table(frame)
    assert list(table.columns[:3]) == ["shape", "concurrency", "engine"]
    assert list(table["shape"]) == ["random_greedy"] * 4 + ["random_sampled"] * 4
    sampled = table[(table["shape"] == "random_sampled") & (table.concurrency == 32)].set_index("engine")
    assert sampled.at["vllm_bf16", "output tok/s"] == 200.0
    assert sampled.at["vllm_bf16", "servelab_http / this tok/s"] == pytest.approx(0.5)   # a loss stays a loss
    greedy = table[(table["shape"] == "random_greedy") & (table.concurrency == 32)].set_index("engine")
    assert greedy.at["vllm_bf16", "servelab_http / this tok/s"] == pytest.approx(1.0)
    checks = target_checks(table, [
        {"shape": "random_sampled", "concurrency": 32, "peer": "vllm_bf16", "ratio": "servelab_http / this tok/s", "at_least": 0.8},
        {"shape": "random_greedy", "concurrency": 32, "peer": "vllm_bf16", "ratio": "servelab_http / this tok/s", "at_least": 0.8},
        {"shape": "random_long", "concurrency": 32, "peer": "vllm_bf16", "ratio": "servelab_http / this tok/s", "at_least": 0.8}])
    assert list(checks.result) == ["NOT met", "met", "not measured"]

    monkeypatch.setattr(table_module, "collect", lambda root: frame)
    table_module.write_peer_table(tmp_path)
    for shape in ("random_greedy", "random_sampled"):
        assert (tmp_path / f"peer_{shape}.png").is_file()
        rows = pd.read_csv(tmp_path / f"peer_table_{shape}.csv")
        assert "shape" not in rows and len(rows) == 4
    assert len(pd.read_csv(tmp_path / "peer_table.csv")) == 8
