"""Build and load servelab's C kernels (``engine/csrc``; CPU, float32).

The kernels are plain C compiled with the machine's C compiler (``$CC``, else ``cc``) the first
time they are needed: ``-O3 -march=native -fopenmp``, about a second each. The shared library is
cached under ``<servelab cache>/kernels/`` (see :func:`engine.loader.cache_root`), keyed by the
sources, the flags, the compiler and the CPU, so a changed kernel or another machine sharing
the cache gets its own build. Builds are atomic (temporary name, then rename), so the parallel
runs of a sweep may race to build without harm.

Why not a torch C++ extension: it needs ninja and compiles the torch headers (a minute or more
on two cores) for what are a few C functions; ``ctypes`` calls them with the tensors' data
pointers. Threads: the library asks for ``libgomp.so.1``, the soname of the OpenMP runtime
torch has already loaded, so the kernels run on torch's thread pool instead of a competing one.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

from engine.paths import cache_root

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c11", "-shared", "-fPIC")


class NativeKernelUnavailable(RuntimeError):
    """The C kernels cannot be built here (no compiler, or the compiler failed)."""


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(line for line in lines[:40] if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise NativeKernelUnavailable(
            f"servelab's CPU kernels are compiled on first use, but no C compiler {compiler!r} was found "
            "(install gcc or set CC; or run without them: attention=torch_sdpa, engine.fused_ops=false)"
        )
    return compiler


@cache
def load(name: str) -> ctypes.CDLL:
    """``csrc/<name>.c`` compiled and loaded (once per process; built once per machine and source)."""
    source = SOURCE_DIR / f"{name}.c"
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    sources = "\0".join(path.read_text() for path in sorted(SOURCE_DIR.glob("*.[ch]")))
    key = hashlib.sha256("\0".join([sources, " ".join(CFLAGS), version, _cpu_identity()]).encode()).hexdigest()[:12]
    library = cache_root() / "kernels" / f"{name}-{key}.so"
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        tmp = library.with_name(f".{library.name}.tmp-{os.getpid()}")
        command = [compiler, *CFLAGS, f"-I{SOURCE_DIR}", str(source), "-o", str(tmp), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise NativeKernelUnavailable(f"compiling {source.name} failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
        os.replace(tmp, library)
    return ctypes.CDLL(str(library))


def require_cpu_float32(tensor, user: str, label: str, hint: str = "") -> None:
    """Raise ``ValueError`` unless ``tensor`` is float32 on the CPU: all the C kernels assume it."""
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        raise ValueError(f"{user} runs float32 on the CPU; {label} is {tensor.dtype} on {tensor.device}{hint}")


def function(library: str, name: str, argtypes: list, restype=None):
    """``library``'s C function ``name`` with its ctypes signature set."""
    func = getattr(load(library), name)
    func.argtypes = argtypes
    func.restype = restype
    return func
