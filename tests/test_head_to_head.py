"""The head-to-head command without servers: the shapes it measures, the server order rotating
per repeat, only the measured server running (the others paused), medians and the faster vLLM per shape, a failed run recorded while the rest go on,
every server stopped, the report files, and bad input refused before anything starts."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from experiments.harness.environment import APPLIED_LOG_PREFIX
from experiments.http import head_to_head
from experiments.http.client_agreement import Server, vllm_bench_command
from experiments.http.head_to_head import cases, server_order, summarize

# output tok/s of each server per (concurrency, temperature), one value per repeat
TOK_S = {
    "servelab": {(8, 0.0): [300.0, 320.0, 310.0], (8, 1.0): [290.0, 280.0, 285.0]},
    "vLLM bfloat16": {(8, 0.0): [200.0, 210.0, 190.0], (8, 1.0): [195.0, 205.0, 200.0]},
    "vLLM float32": {(8, 0.0): [150.0, 140.0, 145.0], (8, 1.0): [250.0, 260.0, 240.0]},
}


def test_cases_cover_every_temperature_and_concurrency_and_refuse_bad_input() -> None:
    measured = cases(128, 64, [1, 8], [0.0, 1.0])
    assert [(c.shape.concurrency, c.temperature) for c in measured] == [(1, 0.0), (8, 0.0), (1, 1.0), (8, 1.0)]
    assert measured[1].name == "in128_out64_c8_t0" and measured[1].shape.num_prompts == 32
    with pytest.raises(ValueError, match="temperatures must be >= 0"):
        cases(128, 64, [8], [-1.0])
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        cases(128, 64, [0], [0.0])


def test_each_server_goes_first_in_turn() -> None:
    labels = ["servelab", "vLLM bfloat16", "vLLM float32"]
    assert [server_order(labels, r)[0] for r in range(4)] == ["servelab", "vLLM bfloat16", "vLLM float32", "servelab"]
    assert sorted(server_order(labels, 2)) == sorted(labels)


def test_the_bench_command_carries_the_temperature() -> None:
    server = Server("http://127.0.0.1:1", "m", Path("/m"))
    command = vllm_bench_command(Path("/p"), server, cases(128, 64, [8], [1.0])[0].shape, 0, Path("/o"), "x.json", 0.7)
    assert command[command.index("--temperature") + 1] == "0.7"


class FakeProcess:
    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.stopped = False
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def stop(self) -> None:
        self.stopped = True


def test_a_run_interleaves_servers_takes_medians_and_records_a_failure(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    processes: list[FakeProcess] = []
    calls: list[tuple[str, int, float]] = []

    def start_server(kind, model, dtype, python, log_dir, servelab_overrides=()):
        log = log_dir / "server.log"
        log.write_text(f"x {APPLIED_LOG_PREFIX}{json.dumps({'prefill_dtype': 'bfloat16'})}\n" if kind == "servelab" else "")
        processes.append(FakeProcess(log))
        label = "servelab" if kind == "servelab" else f"vLLM {dtype}"
        return processes[-1], Server(f"http://127.0.0.1:{len(processes)}", label, Path("/m"))

    def run_vllm_bench(python, server, shape, seed, out, name, temperature=0.0):
        calls.append((server.model, seed, temperature))
        assert [p.paused for p in processes].count(False) == 1, "only the measured server runs"
        assert not processes[int(server.base_url.rsplit(":", 1)[1]) - 1].paused
        if server.model == "vLLM float32" and seed == 1 and temperature == 0.0:
            raise RuntimeError("vllm bench serve exited with code 1")
        tok_s = TOK_S[server.model][(shape.concurrency, temperature)][seed]
        return {"output_throughput": tok_s, "median_ttft_ms": 1000 / tok_s, "median_tpot_ms": 10.0,
                "failed": 0, "completed": shape.num_prompts}

    monkeypatch.setattr(head_to_head, "start_server", start_server)
    monkeypatch.setattr(head_to_head, "run_vllm_bench", run_vllm_bench)
    monkeypatch.setattr(head_to_head, "cpu_build_python", lambda: Path("/v/python"))
    monkeypatch.setattr(head_to_head, "check_vllm_bench", lambda python: None)
    monkeypatch.setattr(head_to_head, "vllm_version", lambda python: "0.32.0")
    out = tmp_path / "h2h"
    head_to_head.main(["--concurrency", "8", "--temperature", "0", "1", "--repeats", "3",
                       "--vllm-dtype", "bfloat16", "float32", "--out", str(out)])

    assert [c[0] for c in calls[:3]] == ["servelab", "vLLM bfloat16", "vLLM float32"]     # repeat 0
    assert [c[0] for c in calls[6:9]] == ["vLLM bfloat16", "vLLM float32", "servelab"]   # repeat 1
    assert all(p.stopped for p in processes) and len(processes) == 3
    report = json.loads((out / "head_to_head.json").read_text())
    assert report["servelab_applied"] == {"prefill_dtype": "bfloat16"} and report["vllm_version"] == "vLLM 0.32.0"
    assert len(report["runs"]) == 18 and sum(run["failed"] for run in report["runs"]) == 1
    greedy, sampled = report["summary"]
    assert greedy["servelab"]["output_throughput"] == {"median": 310.0, "min": 300.0, "max": 320.0}
    assert greedy["vLLM float32 runs"] == 2 and greedy["faster vLLM"] == "vLLM bfloat16"
    assert greedy["ratio"]["output_throughput"] == pytest.approx(310.0 / 200.0)
    assert sampled["faster vLLM"] == "vLLM float32"     # the faster dtype is chosen per shape
    assert sampled["ratio"]["output_throughput"] == pytest.approx(285.0 / 250.0)
    text = (out / "head_to_head.md").read_text()
    assert "| 128 / 64 | 8 | 0 | 310.0 (300.0-320.0) | 200.0 (190.0-210.0) | 147.5 (145.0-150.0) | 1.55x (vLLM bfloat16) |" in text
    rows = list(csv.DictReader((out / "head_to_head.csv").open()))
    assert len(rows) == 18 and {row["server"] for row in rows} == {"servelab", "vLLM bfloat16", "vLLM float32"}
    with pytest.raises(ValueError, match="exists: pick another --out"):   # never overwritten
        head_to_head.main(["--out", str(out)])


def test_a_server_with_no_successful_run_reads_failed() -> None:
    runs = [{"case": "a", "shape": {"input_len": 1, "output_len": 2, "concurrency": 1, "temperature": 0.0},
             "server": server, "failed": server != "servelab",
             "reading": {"output_throughput": 5.0, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0}}
            for server in ("servelab", "vLLM bfloat16")]
    (row,) = summarize(runs, ["servelab", "vLLM bfloat16"])
    assert row["vLLM bfloat16"] is None and row["faster vLLM"] is None and row["ratio"] is None


def test_bad_input_is_refused_before_a_server_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_to_head, "start_server", lambda *a, **k: pytest.fail("a server was started"))
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        head_to_head.main(["--repeats", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        head_to_head.main(["--concurrency", "0", "--out", str(tmp_path)])


def test_a_client_that_cannot_start_stops_the_run_before_any_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho importing the kernels\nkill -ILL $$\n")
    python.chmod(0o755)
    monkeypatch.setattr(head_to_head, "cpu_build_python", lambda: python)
    monkeypatch.setattr(head_to_head, "start_server", lambda *a, **k: pytest.fail("a server was started"))
    with pytest.raises(RuntimeError, match="(?s)vllm bench serve cannot start.*killed by SIGILL.*importing the kernels"):
        head_to_head.main(["--concurrency", "1", "--out", str(tmp_path / "h2h")])
