"""The HTTP load client (vLLM's benchmark rules), vllm_bench.json, and servelab measured over HTTP
by the harness (engine=servelab_http: serve.py as a subprocess, stopped with SIGTERM, exit 0)."""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package ships with
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from engine import LLM, SamplingParams
from engine.config import CONF_DIR
from experiments.http.client import HTTPOutcome, HTTPTarget, drive_result, run_load
from experiments.harness.job import execute
from experiments.harness.metrics import SLO
from experiments.http.server_process import free_loopback_port, server_config, start_serve_py
from experiments.http.vllm_bench import VLLM_RESULT_KEYS, vllm_bench_result
from experiments.harness.workloads import WorkloadRequest, special_token_ids
from server_harness import live_server, wrap_forward


def compose_run(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["model=tiny", "workload=burst", "plots=false", "driver.progress=false", *overrides])


def request(name: str, prompt: list[int], max_tokens: int, offset: float = 0.0) -> WorkloadRequest:
    return WorkloadRequest(name, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), offset)


def test_servelab_over_http_matches_in_process_and_writes_vllm_keys(tmp_path: Path) -> None:
    cfg = compose_run("engine=servelab_http", "workload.concurrency=4", "cache=prefix", "engine.prepack=false",
                      "engine.fused_ops=false")
    remote = execute(cfg, tmp_path, {"engine": "servelab_http", "cache": "prefix"}, [])
    assert remote.summary["status"] == "ok", remote.summary.get("error")
    llm = LLM(model="tiny", cache="prefix", device="cpu")
    workload = instantiate(cfg.workload, vocab_size=llm.model_config.vocab_size,
                           special_token_ids=special_token_ids(llm.model_config))
    expected = llm.generate([r.prompt_token_ids for r in workload], [r.sampling_params for r in workload])
    requests = pd.read_csv(tmp_path / "requests.csv").set_index("request_id")
    assert {r.request_id: " ".join(map(str, o.token_ids)) for r, o in zip(workload, expected)} == \
        requests["output_token_ids"].to_dict()  # greedy over HTTP == in-process, request by request
    metrics = remote.summary["metrics"]
    assert metrics["num_failed_requests"] == 0
    assert metrics["server_generation_tokens"] == metrics["total_output_tokens"]
    assert metrics["server_prompt_tokens"] == metrics["total_prompt_tokens"]
    bench = json.loads((tmp_path / "vllm_bench.json").read_text())
    assert set(VLLM_RESULT_KEYS) <= set(bench)
    assert bench["completed"] == metrics["num_requests"] and bench["failed"] == 0
    assert bench["total_output_tokens"] == metrics["total_output_tokens"]
    environment = remote.summary["environment"]  # what the server's engine applied, as serve.py logged it
    assert environment["engine_class"] == "ServelabHTTPEngine" and environment["server_command"]
    assert environment["prepacked"] is False and environment["fused_ops"] is False
    assert environment["attention_backend"] == llm.attention.name and environment["quantized_weights"] is None


def test_failed_requests_are_counted_with_reasons_and_left_out() -> None:
    llm = LLM(model="tiny", device="cpu")
    fail_next = threading.Event()

    def maybe_fail() -> None:
        if fail_next.is_set():
            fail_next.clear()
            raise RuntimeError("injected")

    wrap_forward(llm, maybe_fail)
    with live_server(llm) as url:
        target = HTTPTarget(f"{url}/v1", "tiny", timeout_s=30)
        ok = [request("ok-0", [5, 6, 7], 4), request("ok-1", [8, 9], 3)]
        too_long = request("too-long", [5] * 600, 4)
        good = asyncio.run(run_load(target, [*ok, too_long], max_concurrency=2, progress=False))
        fail_next.set()
        broken = asyncio.run(run_load(target, [request("in-stream", [5, 6], 4)], None, progress=False))
        nowhere = asyncio.run(run_load(HTTPTarget(f"http://127.0.0.1:{free_loopback_port()}/v1", "tiny", timeout_s=5),
                                       [request("refused", [1], 1)], None, progress=False))
        wrong_model = asyncio.run(run_load(HTTPTarget(f"{url}/v1", "gpt-4"), [request("model", [1], 1)], None,
                                           progress=False))
    result = drive_result(good)
    assert [r.request_id for r in result.records] == ["ok-0", "ok-1"]
    assert [r.output_tokens for r in result.records] == [4, 3]
    assert all(len(r.token_times_s) == r.output_tokens for r in result.records)
    assert result.extra_metrics["num_failed_requests"] == 1
    assert result.failures[0]["request_id"] == "too-long" and "HTTP 400" in result.failures[0]["error"]
    assert "injected" in broken.outcomes[0].error and not broken.outcomes[0].success
    assert "ClientConnectorError" in nowhere.outcomes[0].error
    assert "HTTP 400" in wrong_model.outcomes[0].error and "gpt-4" in wrong_model.outcomes[0].error
    bench = vllm_bench_result(good.outcomes, good.wall_s, "openai", "tiny", None, "inf", 1.0, 2, SLO())
    assert (bench["completed"], bench["failed"], bench["output_lens"]) == (2, 1, [4, 3, 0])
    assert bench["errors"][:2] == ["", ""] and "HTTP 400" in bench["errors"][2]


def test_vllm_bench_definitions_by_hand() -> None:
    def outcome(start: float, chunks: list[float], tokens: int, arrival: float = 0.0) -> HTTPOutcome:
        return HTTPOutcome(request("r", [1, 2, 3], tokens), arrival=arrival, start=start, chunk_times=chunks,
                           output_tokens=tokens, prompt_tokens=3)

    outcomes = [outcome(0.0, [0.5, 0.7, 1.0], 3), outcome(0.5, [1.5, 2.5], 2, arrival=0.2),
                HTTPOutcome(request("failed", [1], 5), start=0.1, error="HTTP 500")]
    bench = vllm_bench_result(outcomes, 4.0, "openai", "m", None, "inf", 1.0, 2, SLO(ttft_s=0.6))
    assert bench["completed"] == 2 and bench["failed"] == 1
    assert bench["total_output_tokens"] == 5 and bench["output_throughput"] == 5 / 4.0
    assert bench["total_input_tokens"] == 6
    assert bench["mean_ttft_ms"] == pytest.approx((500 + 1000) / 2)
    assert bench["mean_tpot_ms"] == pytest.approx(((1.0 - 0.5) / 2 + (2.0 - 1.0) / 1) / 2 * 1000)
    assert bench["mean_itl_ms"] == pytest.approx((200 + 300 + 1000) / 3)
    assert bench["mean_e2el_ms"] == pytest.approx((1000 + 2000) / 2)
    assert bench["request_goodput"] == 1 / 4.0  # only the first meets TTFT <= 0.6 s
    assert bench["max_concurrent_requests"] == 2
    assert bench["max_output_tokens_per_s"] == 2  # one-second buckets of chunk times: [0.5, 0.7], [1.0, 1.5], [2.5]
    assert bench["mean_client_queue_time_ms"] == pytest.approx((0 + 300) / 2)


def test_sigterm_aborts_in_flight_streams_and_exits_zero(tmp_path: Path) -> None:
    cfg = compose_run("model.hf_config.max_position_embeddings=4096")  # room for 4,000-token answers
    config = server_config(cfg, {}, {"max_waiting": 64, "warmup_requests": 1, "served_model_name": "tiny",
                                     "api_key": None, "graceful_shutdown_s": 5.0, "log_level": "info"},
                           free_loopback_port(), tmp_path)
    process = start_serve_py(config, tmp_path, startup_timeout_s=120, stop_timeout_s=20)
    body = {"model": "tiny", "max_tokens": 4000, "ignore_eos": True, "stream": True}  # seconds of work per stream
    endings: list[str] = []

    def stream(prompt: list[int], started: threading.Event) -> None:
        with httpx.stream("POST", f"{process.base_url}/completions", json={**body, "prompt": prompt},
                          timeout=30) as response:
            lines = []
            for line in response.iter_lines():
                started.set()
                if line:
                    lines.append(line)
            finish = [json.loads(l[6:])["choices"][0]["finish_reason"] for l in lines
                      if l.startswith("data: {") and '"choices":[{' in l]
            endings.append(f"{finish[-1]}:{len(finish)}:{lines[-1]}")

    starts = [threading.Event() for _ in range(4)]
    threads = [threading.Thread(target=stream, args=([3 + i, 4, 5], s)) for i, s in enumerate(starts)]
    for thread in threads:
        thread.start()
    assert all(s.wait(60) for s in starts)
    code = process.stop()
    for thread in threads:
        thread.join(30)
    assert code == 0
    assert len(endings) == 4
    for ending in endings:
        reason, chunks, last = ending.split(":", 2)
        assert reason == "abort" and int(chunks) < 4000 and last == "data: [DONE]"
