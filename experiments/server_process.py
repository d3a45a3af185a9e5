"""Start ``serve.py`` as a subprocess on a free loopback port, wait until it is healthy, stop it.

``engine=servelab_http`` uses this to measure servelab through its own HTTP server with exactly the
run's strategy config: the composed groups (model, cache, scheduler, attention), the engine's
performance options, device, dtype and seed are written, resolved, into ``server_config.yaml`` in
the run folder, and ``serve.py`` is started on that file (``--config-path/--config-name``), so
every override of the run applies to the server too. The server's output goes to ``server.log``.

Startup is bounded (``startup_timeout_s``; a server that exits early fails at once, with the tail of
its log); stop sends SIGTERM (the server aborts what is in flight and exits 0), waits
``stop_timeout_s``, then kills.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import urllib.request
from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
STRATEGY_GROUPS = ("model", "cache", "scheduler", "attention")


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_config(cfg: DictConfig, engine_options: dict[str, Any], server_options: dict[str, Any],
                  port: int, run_dir: Path) -> dict[str, Any]:
    """The resolved serve.py config for this run (see the module docstring)."""
    node: dict[str, Any] = {"defaults": ["_self_", {"override hydra/job_logging": "stdout"}]}
    for group in STRATEGY_GROUPS:
        node[group] = OmegaConf.to_container(cfg[group], resolve=True)
    node["engine"] = {"_target_": "engine.LLM.from_config", "_partial_": True, **engine_options}
    node["server"] = {**server_options, "host": "127.0.0.1", "port": port}
    node.update(device=cfg.device, dtype=cfg.dtype, seed=cfg.seed)
    node["hydra"] = {"output_subdir": None, "run": {"dir": str(run_dir)}, "job": {"chdir": False}}
    return node


class ServerProcess:
    """A running ``serve.py``; use as a context manager or call :meth:`stop`."""

    def __init__(self, config: dict[str, Any], run_dir: Path, startup_timeout_s: float, stop_timeout_s: float) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.port = config["server"]["port"]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.stop_timeout_s = stop_timeout_s
        config_file = run_dir / "server_config.yaml"
        OmegaConf.save(OmegaConf.create(config), config_file)
        self.log_path = run_dir / "server.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "serve.py"), f"--config-path={run_dir.resolve()}",
             "--config-name=server_config"],
            cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ),
        )
        try:
            self.wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve.py exited with code {self.process.returncode} during startup:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"serve.py was not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int | None:
        """SIGTERM, bounded wait, then SIGKILL; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(self.stop_timeout_s)
        self.log.close()
        return self.process.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
