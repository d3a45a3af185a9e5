"""llama.cpp's ``llama-server`` and ``llama-quantize`` for the ``engine=llamacpp`` peer: found or built once.

llama.cpp is what CPU users run, so servelab measures itself against it. The binaries are an
optional extra, never part of CI, found in this order:

1. ``llama-server`` (and ``llama-quantize`` beside it, or on ``PATH``) on ``PATH``;
2. a build cached under servelab's cache directory (:func:`engine.paths.cache_root`):
   ``<cache>/llama.cpp/<version>-<machine key>/bin/``;
3. otherwise that build is made, once: the sdist of ``llama-cpp-python`` (:data:`SDIST_VERSION`)
   is downloaded with pip (``pip download --no-binary :all: --no-deps``), its vendored
   ``vendor/llama.cpp`` is configured with cmake (``-DLLAMA_CURL=OFF -DGGML_NATIVE=ON``, static
   libraries so the two binaries stand alone) and the targets ``llama-server`` and
   ``llama-quantize`` are built with every core (~8 minutes on 2 cores).

``GGML_NATIVE=ON`` compiles for *this* CPU's instruction set, so the cache key includes the
machine (architecture and CPU flags): a cache copied to another machine is rebuilt there, not
run with illegal instructions. The build happens in a temporary folder beside the final one
and is renamed into place only when both binaries exist, so a killed build leaves nothing
half-made (a later build removes the stale temporary folder). Missing tools (cmake, a C and a
C++ compiler, pip's download) fail before anything starts, with an error naming what to install.

:func:`requantized_gguf` makes (once, cached the same way) a copy of a GGUF file in another
type with ``llama-quantize --allow-requantize``: ``F32`` gives llama.cpp the very weights
servelab computes with (the Q4_1 file dequantized), a like-for-like comparison.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from engine.paths import cache_root

SDIST_PACKAGE = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-quantize")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",          # no libcurl: models are local files
    "-DGGML_NATIVE=ON",          # this CPU's instruction set (AVX2/AVX-512...): what a user building it gets
    "-DBUILD_SHARED_LIBS=OFF",   # static: the cached binaries do not depend on the build tree
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
COMPILERS = {"C compiler": ("cc", "gcc", "clang"), "C++ compiler": ("c++", "g++", "clang++")}


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp's binaries are neither found nor buildable here; the message says what is needed."""


@dataclass(frozen=True)
class LlamaCppBinaries:
    server: Path
    quantize: Path


def machine_key() -> str:
    """A short hash of what a ``GGML_NATIVE`` build depends on: the architecture and the CPU flags."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        lines = cpuinfo.read_text(errors="replace").splitlines()
        flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return hashlib.sha256(f"{platform.machine()}|{flags}".encode()).hexdigest()[:10]


def build_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the build for this machine lives (``bin/`` holds the binaries)."""
    return cache_root(cache_dir) / "llama.cpp" / f"{SDIST_VERSION}-{platform.machine()}-{machine_key()}"


def on_path() -> LlamaCppBinaries | None:
    """``llama-server`` on PATH, with ``llama-quantize`` beside it or on PATH; else ``None``."""
    server = shutil.which("llama-server")
    if server is None:
        return None
    beside = Path(server).with_name("llama-quantize")
    quantize = str(beside) if beside.is_file() else shutil.which("llama-quantize")
    if quantize is None:
        return None
    return LlamaCppBinaries(Path(server), Path(quantize))


def cached(cache_dir: str | Path | None = None) -> LlamaCppBinaries | None:
    """The cached build for this machine, if complete; else ``None``."""
    bin_dir = build_dir(cache_dir) / "bin"
    binaries = LlamaCppBinaries(bin_dir / "llama-server", bin_dir / "llama-quantize")
    return binaries if binaries.server.is_file() and binaries.quantize.is_file() else None


def find_binaries(cache_dir: str | Path | None = None, build: bool = True) -> LlamaCppBinaries:
    """PATH, then the cache, then (``build=True``) a build; raises :class:`LlamaCppUnavailable`."""
    found = on_path() or cached(cache_dir)
    if found is not None:
        return found
    if not build:
        raise LlamaCppUnavailable(f"llama-server is not on PATH and not built in {build_dir(cache_dir)}")
    return build_binaries(cache_dir)


def missing_tools() -> list[str]:
    """What a build needs and this machine lacks (empty when all is there)."""
    missing = [] if shutil.which("cmake") else ["cmake (e.g. `apt-get install cmake` or `pip install cmake`)"]
    for role, names in COMPILERS.items():
        if not any(shutil.which(name) for name in names):
            missing.append(f"a {role} ({' / '.join(names)}; e.g. `apt-get install build-essential`)")
    return missing


def cmake_commands(source: Path, build: Path, jobs: int) -> list[list[str]]:
    """The configure and build command lines for llama.cpp's ``source`` tree into ``build``."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return [
        ["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_OPTIONS],
        ["cmake", "--build", str(build), "--parallel", str(jobs), "--target", *TARGETS],
    ]


def build_binaries(cache_dir: str | Path | None = None) -> LlamaCppBinaries:
    """Download, configure and build llama.cpp into the cache (see the module docstring)."""
    missing = missing_tools()
    if missing:
        raise LlamaCppUnavailable("building llama-server needs " + " and ".join(missing)
                                  + "; or put a llama-server (and llama-quantize) on PATH")
    final = build_dir(cache_dir)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    for stale in final.parent.glob(f".{final.name}.tmp-*") if final.parent.is_dir() else []:
        if not process_alive(int(stale.name.rpartition("-")[2])):  # a killed build's leftovers
            shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        source = unpack_sdist(download_sdist(tmp / "download"), tmp / "src")
        log_path = tmp / "build.log"
        with log_path.open("w") as log:
            for command in cmake_commands(source, tmp / "build", os.cpu_count() or 1):
                print(f"[llama.cpp] {' '.join(command)}  (log: {log_path})", file=sys.stderr, flush=True)
                if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
                    raise LlamaCppUnavailable(f"llama.cpp build failed: {' '.join(command)}\n{tail}")
        (tmp / "bin").mkdir()
        for target in TARGETS:
            shutil.copy2(tmp / "build" / "bin" / target, tmp / "bin" / target)
        shutil.copy2(log_path, tmp / "bin" / "build.log")
        for scratch in ("download", "src", "build"):
            shutil.rmtree(tmp / scratch, ignore_errors=True)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first: keep its copy
            if cached(cache_dir) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    found = cached(cache_dir)
    assert found is not None
    return found


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def download_sdist(into: Path) -> Path:
    """The ``llama-cpp-python`` sdist, downloaded with pip into ``into``."""
    into.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               f"{SDIST_PACKAGE}=={SDIST_VERSION}", "-d", str(into)]
    done = subprocess.run(command, capture_output=True, text=True)
    archives = sorted(into.glob("*.tar.gz"))
    if done.returncode != 0 or not archives:
        raise LlamaCppUnavailable(f"could not download the {SDIST_PACKAGE}=={SDIST_VERSION} sdist (llama.cpp's sources) "
                                  f"with pip: network access to PyPI is needed, or put llama-server on PATH.\n"
                                  f"{' '.join(command)}\n{(done.stdout + done.stderr)[-2000:]}")
    return archives[0]


def unpack_sdist(archive: Path, into: Path) -> Path:
    """Unpack ``archive`` into ``into``; returns its vendored llama.cpp source tree."""
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    trees = [path.parent for path in into.glob("*/vendor/llama.cpp/CMakeLists.txt")]
    if len(trees) != 1:
        raise LlamaCppUnavailable(f"{archive.name} has no vendor/llama.cpp source tree")
    return trees[0]


def requantized_gguf(source: str | Path, file_type: str, binaries: LlamaCppBinaries,
                     cache_dir: str | Path | None = None) -> Path:
    """``source`` converted to ``file_type`` (e.g. ``F32``) with ``llama-quantize --allow-requantize``,
    made once and cached (key: the source's path, size and mtime; written to a temporary name, then renamed)."""
    source = Path(source).resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{file_type}".encode()).hexdigest()[:10]
    final = cache_root(cache_dir) / "gguf" / f"{source.stem}.{file_type}-{key}.gguf"
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        done = subprocess.run([str(binaries.quantize), "--allow-requantize", str(source), str(tmp), file_type],
                              capture_output=True, text=True)
        if done.returncode != 0 or not tmp.is_file():
            raise RuntimeError(f"llama-quantize {file_type} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}")
        tmp.rename(final)
    finally:
        tmp.unlink(missing_ok=True)
    return final
