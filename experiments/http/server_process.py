"""Start a server as a subprocess on a free loopback port, wait until it is healthy, stop it.

:class:`ServerProcess` runs any server command (``serve.py``, llama.cpp's ``llama-server``) in its
own process group, with its output in a log file. Startup is bounded (``startup_timeout_s``: a
server that exits early fails at once, with the tail of its log; one that never answers
``GET /health`` with 200 is stopped and fails); stop sends SIGTERM to the whole group (servelab's
server aborts what is in flight and exits 0), waits ``stop_timeout_s``, then kills the group, so
nothing the server started outlives the run.

``engine=servelab_http`` uses :func:`start_serve_py` to measure servelab through its own HTTP
server with exactly the run's strategy config: the composed groups (model, cache, scheduler,
attention), the engine's performance options, device, dtype and seed are written, resolved, into
``server_config.yaml`` in the run folder, and ``serve.py`` is started on that file
(``--config-path/--config-name``), so every override of the run applies to the server too.

Peers (llama.cpp, vLLM) start their own servers the same way: ``env`` adds variables to the
server's environment (vLLM's CPU settings), ``cwd`` is where it runs. A server that fails to
start, or exits with an error, raises :class:`ServerError`, whose ``log_tail`` the run's
``summary.json`` records (``server_log_tail``).
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import urllib.request
from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[2]
STRATEGY_GROUPS = ("model", "cache", "scheduler", "attention")


def last_lines(text: str, lines: int) -> str:
    """The last ``lines`` lines of ``text`` (a log's tail for an error message)."""
    return "\n".join(text.splitlines()[-lines:])


def exit_status(code: int) -> str:
    """How a child process ended, for error messages: ``"exited with code 2"``, or for the negative
    codes :mod:`subprocess` gives a process killed by a signal, the signal's name; SIGILL (an
    instruction this CPU does not have, e.g. a build for AVX-512 on an AVX2-only CPU) says so."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"was killed by signal {-code}"
    hint = " (an instruction this CPU does not have: a build for another CPU?)" if name == "SIGILL" else ""
    return f"was killed by {name}{hint}"


class ServerError(RuntimeError):
    """A server exited (at startup or with an error) or never became healthy; ``log_tail`` is the end of its log."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(f"{message}:\n{log_tail}")
        self.reason = message
        self.log_tail = log_tail


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


def start_serve_py(config: dict[str, Any], run_dir: Path, startup_timeout_s: float,
                   stop_timeout_s: float) -> "ServerProcess":
    """``serve.py`` on ``config`` (from :func:`server_config`), written to ``run_dir/server_config.yaml``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "server_config.yaml"
    OmegaConf.save(OmegaConf.create(config), config_file)
    command = [sys.executable, str(REPO_ROOT / "serve.py"), f"--config-path={run_dir.resolve()}",
               "--config-name=server_config"]
    return ServerProcess(command, config["server"]["port"], run_dir / "server.log", startup_timeout_s, stop_timeout_s)


class ServerProcess:
    """A running server (``command``, listening on 127.0.0.1:``port``); a context manager, or call :meth:`stop`."""

    def __init__(self, command: list[str], port: int, log_path: Path, startup_timeout_s: float,
                 stop_timeout_s: float, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.command = command
        self.name = Path(command[1] if command[0] == sys.executable else command[0]).name
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.stop_timeout_s = stop_timeout_s
        self.log_path = log_path
        self.log = log_path.open("w")
        self.log.write(f"$ {shlex.join(command)}\n")
        self.log.flush()
        self.process = subprocess.Popen(command, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            self.wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"{self.name} {exit_status(self.process.returncode)} during startup",
                                       self.log_tail())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise ServerError(f"{self.name} was not healthy after {timeout_s:.0f} s", self.log_tail())

    def log_tail(self, lines: int = 20) -> str:
        if not self.log.closed:
            self.log.flush()
        return last_lines(self.log_path.read_text(errors="replace"), lines)

    def pause(self) -> None:
        """SIGSTOP to the process group: the server takes no CPU (nor spins) until :meth:`resume`,
        e.g. while another server beside it is measured on the same cores."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT to the process group (after :meth:`pause`)."""
        self._signal_group(signal.SIGCONT)

    def stop(self) -> int | None:
        """SIGTERM to the process group, bounded wait, then SIGKILL to the group; returns the exit code.
        A paused server is resumed first, so it can handle the SIGTERM."""
        if self.process.poll() is None:
            self.resume()
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait(self.stop_timeout_s)
        self._signal_group(signal.SIGKILL)  # whatever the server started and left behind
        self.log.close()
        return self.process.returncode

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)  # start_new_session: the group id is the server's pid
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
