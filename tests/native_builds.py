"""A C kernel's AVX2 code path on an AVX-512 machine, for tests.

servelab's kernels pick their vector width and register tiles at compile time (``-march=native``),
so an AVX-512 machine never runs the AVX2 code that the project's AVX2 machines run. This builds
a kernel source again with ``-mno-avx512f`` and re-points a Python wrapper's ctypes functions at
that library, so the same test can run both builds. :func:`build_without` is the build alone, for
tests of what a kernel's build without an instruction set says about itself.
"""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from engine import native


def build_without(source: str, flags: list[str], tmp_path: Path) -> ctypes.CDLL | None:
    """``source`` built with the engine's flags plus ``flags`` (e.g. ``-mno-avx512f``) into
    ``tmp_path``; ``None`` where the compiler has no such flag (not x86)."""
    library = tmp_path / f"{Path(source).stem}_{'_'.join(flag.lstrip('-') for flag in flags)}.so"
    command = [native._compiler(), *native.CFLAGS, *flags, f"-I{native.SOURCE_DIR}",
               str(native.SOURCE_DIR / source), "-o", str(library), "-lm"]
    if subprocess.run(command, capture_output=True).returncode != 0:
        return None
    return ctypes.CDLL(str(library))


def without_avx512(wrapper: object, source: str, functions: dict[str, str], tmp_path: Path) -> ctypes.CDLL | None:
    """Rebind ``wrapper``'s ctypes functions (attribute -> C name in ``functions``) to ``source``
    built without AVX-512, keeping their signatures; returns the library, or ``None`` where the
    compiler has no such flag (not x86)."""
    kernels = build_without(source, ["-mno-avx512f"], tmp_path)
    if kernels is None:
        return None
    for attribute, name in functions.items():
        function, bound = getattr(kernels, name), getattr(wrapper, attribute)
        function.argtypes, function.restype = bound.argtypes, bound.restype
        setattr(wrapper, attribute, function)
    return kernels
