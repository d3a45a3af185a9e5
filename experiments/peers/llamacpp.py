"""``engine=llamacpp``: llama.cpp's ``llama-server`` as a peer, measured over HTTP like servelab's server.

llama.cpp is what CPU users run. The harness gets the binaries (:mod:`experiments.peers.llamacpp_build`:
on PATH, cached, or built once), picks the GGUF file of the run's model (``model.path`` when it
is a ``.gguf`` file, else the file shipped in ``model.gguf_package``), converts it to the weight
type asked for (``weights``; cached), and starts ``llama-server`` on a free 127.0.0.1 port with

* ``-t`` threads (default: as many as servelab's torch uses, ``torch.get_num_threads()``: the
  machine's cores, as llama.cpp's users run it, unless ``OMP_NUM_THREADS`` sets fewer for every engine),
* ``-np`` parallel slots = the run's concurrency, continuous batching on (``-cb``),
* ``-c`` context = slots x ``ctx_per_slot`` (each slot holds one request's prompt + output),
* ``--alias`` = the model's name (the ``model`` field of requests).

It waits for ``/health`` (bounded), then sends the run's workload with the HTTP load client
(:class:`experiments.http.engines.OpenAIEngine`: streamed completions with token-id prompts,
``ignore_eos``, vLLM's benchmark rules), writes the same result files as every engine, and stops
the server's process group at the end, also when the run fails.

``weights`` is a llama.cpp file type: ``f32`` gives llama.cpp the very weights servelab computes
with (the shipped Q4_1 file dequantized, what servelab loads), a like-for-like comparison;
``q4_1`` is the shipped file as is (Q4_1, embedding in Q8_0): what llama.cpp's users run. A type
the file already has is served as is; another is made once with ``llama-quantize
--allow-requantize`` and cached.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from engine.package_files import locate_package_file
from experiments.http.client import HTTPTarget
from experiments.http.engines import StartedServerEngine, run_folder
from experiments.peers.llamacpp_build import LlamaCppBinaries, find_binaries, requantized_gguf
from experiments.http.server_process import ServerProcess, free_loopback_port


def model_gguf(model: DictConfig | dict[str, Any]) -> Path:
    """The GGUF file of a model spec (``path`` ending in ``.gguf``, or ``gguf_package`` + ``gguf_file``);
    ``ValueError`` naming the model when it has none (llama.cpp only reads GGUF files)."""
    path = model.get("path")
    if path and str(path).endswith(".gguf"):
        return Path(str(path)).expanduser()
    if model.get("gguf_package"):
        return locate_package_file(model["gguf_package"], model["gguf_file"])
    raise ValueError(f"engine=llamacpp serves a GGUF file, and model {model.get('name')!r} has none "
                     f"(set model.path to a .gguf file, or use a model with gguf_package, e.g. model=smollm2-135m-instruct)")


def gguf_file_type(path: Path) -> str:
    """The file's ``general.file_type`` as llama-quantize names it (``F32``, ``Q4_1``, ...); read
    once per version of the file (path, size, modification time)."""
    source = Path(path).resolve()
    stat = source.stat()
    return _gguf_file_type(source, stat.st_size, stat.st_mtime_ns)


@functools.cache
def _gguf_file_type(source: Path, size: int, mtime_ns: int) -> str:
    """(``size`` and ``mtime_ns`` key the cache: ``GGUFReader`` parses the whole header, about 2 s
    for SmolLM2's 49,152-token vocabulary on a 2-core machine.)"""
    import gguf

    field = gguf.GGUFReader(str(source)).fields.get("general.file_type")
    if field is None:
        return "unknown"
    return gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")


def served_file(source: Path, weights: str, binaries: LlamaCppBinaries, cache_dir: str | None = None) -> Path:
    """``source`` itself when it already has type ``weights``, else a cached ``llama-quantize`` copy."""
    if gguf_file_type(source) == weights.upper():
        return source
    return requantized_gguf(source, weights.upper(), binaries, cache_dir)


def llama_server_command(server: Path, model_file: Path, port: int, alias: str, threads: int, slots: int,
                         ctx_per_slot: int, extra_args: list[str]) -> list[str]:
    """The ``llama-server`` command line (see the module docstring)."""
    return [str(server), "--model", str(model_file), "--host", "127.0.0.1", "--port", str(port), "--alias", alias,
            "--threads", str(threads), "--parallel", str(slots), "--ctx-size", str(slots * ctx_per_slot),
            "--cont-batching", "--no-webui", *extra_args]


class LlamaCppEngine(StartedServerEngine):
    """llama.cpp's server, started for this run (see the module docstring)."""

    @classmethod
    def from_config(cls, cfg: DictConfig, weights: str = "f32", threads: int | None = None, slots: int | None = None,
                    ctx_per_slot: int = 1024, extra_args: Any = (), build: bool = True, timeout_s: float = 600.0,
                    metrics_interval_s: float = 0.0, startup_timeout_s: float = 120.0,
                    stop_timeout_s: float = 15.0) -> "LlamaCppEngine":
        if not slots:
            raise ValueError("engine=llamacpp needs engine.slots (llama-server's -np): the run has no concurrency cap")
        source = model_gguf(cfg.model)  # first: a model without a GGUF file fails before any build
        binaries = find_binaries(build=build)
        model_file = served_file(source, weights, binaries)
        port, name = free_loopback_port(), str(cfg.model.name)
        command = llama_server_command(binaries.server, model_file, port, name, threads or torch.get_num_threads(),
                                       slots, ctx_per_slot, [str(arg) for arg in extra_args or ()])
        process = ServerProcess(command, port, run_folder() / "server" / "server.log", startup_timeout_s, stop_timeout_s)
        return cls(cfg, process, HTTPTarget(process.base_url, name, "completions", None, timeout_s), metrics_interval_s)
