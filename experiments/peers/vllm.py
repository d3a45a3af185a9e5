"""``engine=vllm``: vLLM's OpenAI server as a peer, measured over HTTP like servelab's server.

vLLM is the system every serving lab is measured against, and its CPU build runs on a laptop-class
CPU. The harness gets a Python that has vLLM (:mod:`experiments.peers.vllm_install`: the user's on
CUDA, servelab's own virtual environment on CPU, installed on first use), and starts

    python -m vllm.entrypoints.openai.api_server --model <the run's HF folder> ...

on a free 127.0.0.1 port: the very folder servelab loads (``checkpoint_for_spec``: a ``.gguf``
model is converted first, into servelab's cache), served under the model's name, with

* ``--dtype`` (``float32`` | ``bfloat16`` | ``auto``: the folder's ``torch_dtype``);
* ``--max-num-batched-tokens`` (vLLM's per-step token budget; ``null`` = vLLM's default);
* ``--enable-prefix-caching`` or ``--no-enable-prefix-caching`` (always said: vLLM's default
  changed between versions);
* ``extra_args`` after them (e.g. ``[--max-num-seqs, "64"]``).

On CPU its environment gets ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (vLLM otherwise keeps one core for
its front end: half of a 2-core machine) and ``VLLM_CPU_KVCACHE_SPACE`` (its KV budget, GiB). The
server runs in the run's ``server/`` folder (``python -m`` puts its working directory on the path:
not the repository's packages), its output in ``server/server.log``. Its first start compiles for
~60-90 s (cached by vLLM afterwards), hence the long ``startup_timeout_s``.

It waits for ``/health``, sends the run's workload with servelab's HTTP load client (text prompts as
text, vLLM's benchmark rules), writes the same result files as every engine, and stops the
server's whole process group at the end, also when the run fails or is interrupted. A server that
cannot start fails the run with vLLM's version, options and log tail (``summary.json``'s ``error``
and ``server_log_tail``); a sweep carries on. ``summary.json``'s environment records vLLM's version,
dtype and options.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from engine.loader import checkpoint_for_spec
from experiments.http.client import HTTPTarget
from experiments.http.engines import StartedServerEngine, run_folder
from experiments.http.server_process import ServerError, ServerProcess, free_loopback_port
from experiments.peers.vllm_install import vllm_python, vllm_version

DTYPES = ("float32", "bfloat16", "auto")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class VLLMOptions:
    """The options servelab passes to vLLM's server (see the module docstring)."""

    dtype: str = "float32"
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = False
    kv_cache_space_gib: float = 4.0
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"engine.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"engine.max_num_batched_tokens must be >= 1 or null, got {self.max_num_batched_tokens}")
        if self.kv_cache_space_gib <= 0:
            raise ValueError(f"engine.kv_cache_space_gib must be > 0, got {self.kv_cache_space_gib}")


def vllm_server_command(python: Path, model_dir: Path, port: int, name: str, options: VLLMOptions) -> list[str]:
    """The server's command line."""
    command = [str(python), "-m", SERVER_MODULE, "--model", str(model_dir), "--served-model-name", name,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", options.dtype]
    if options.max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
    command.append("--enable-prefix-caching" if options.enable_prefix_caching else "--no-enable-prefix-caching")
    return command + list(options.extra_args)


def vllm_server_env(options: VLLMOptions, on_cuda: bool) -> dict[str, str]:
    """Variables added to the server's environment (CPU settings; none on CUDA)."""
    if on_cuda:
        return {}
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": f"{options.kv_cache_space_gib:g}"}


def runs_on_cuda(device: str) -> bool:
    """The run's device (``auto``, ``cuda``, ``cuda:N``) is a CUDA device, and this machine has one."""
    return torch.cuda.is_available() and (str(device) in ("auto", "cuda") or str(device).startswith("cuda:"))


class VLLMEngine(StartedServerEngine):
    """vLLM's server, started for this run (see the module docstring)."""

    def __init__(self, cfg: DictConfig, process: ServerProcess, target: HTTPTarget, metrics_interval_s: float,
                 description: dict[str, Any]) -> None:
        super().__init__(cfg, process, target, metrics_interval_s)
        self.server_applied_options = description   # summary.json's environment records it

    @classmethod
    def from_config(cls, cfg: DictConfig, dtype: str = "float32", max_num_batched_tokens: int | None = None,
                    enable_prefix_caching: bool = False, kv_cache_space_gib: float = 4.0, extra_args: Any = (),
                    python: str | None = None, install: bool = True, timeout_s: float = 600.0,
                    extra_body: Any = None, metrics_interval_s: float = 0.0, startup_timeout_s: float = 900.0,
                    stop_timeout_s: float = 30.0) -> "VLLMEngine":
        options = VLLMOptions(dtype, max_num_batched_tokens, enable_prefix_caching, kv_cache_space_gib,
                              [str(arg) for arg in extra_args or ()])
        model_dir = checkpoint_for_spec(cfg.model)   # the folder servelab loads (a GGUF converted, cached)
        on_cuda = runs_on_cuda(cfg.get("device", "auto"))
        interpreter = vllm_python(python, on_cuda, install=install)
        description = {"dtype": options.dtype, "vllm_version": vllm_version(interpreter),
                       "vllm_options": asdict(options), "vllm_python": str(interpreter)}
        port, name = free_loopback_port(), str(cfg.model.name)
        command = vllm_server_command(interpreter, model_dir, port, name, options)
        server_dir = run_folder() / "server"
        try:
            process = ServerProcess(command, port, server_dir / "server.log", startup_timeout_s, stop_timeout_s,
                                    env=vllm_server_env(options, on_cuda), cwd=server_dir)
        except ServerError as error:
            raise ServerError(f"vLLM {description['vllm_version']} did not start ({options}); "
                              f"{error.reason}", error.log_tail) from error
        extra = OmegaConf.to_container(extra_body, resolve=True) if isinstance(extra_body, DictConfig) else extra_body
        target = HTTPTarget(process.base_url, name, "completions", None, timeout_s, dict(extra or {}))
        return cls(cfg, process, target, metrics_interval_s, description)
