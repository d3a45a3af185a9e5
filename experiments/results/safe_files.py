"""Result files that survive a crash and never replace each other.

A run can die at any moment (killed, out of memory, a power cut). A file written in place is
then left truncated under its final name, and a reader (``experiments.results.report``) cannot tell it
from a finished one. So every result file is written the way databases and editors do it:

1. fill a hidden temporary file in the same folder (``.name.partial-<pid>.ext``: same
   filesystem, so the next step is atomic; same extension, so writers that pick the format
   from it, like matplotlib, still do);
2. flush it to disk (``fsync``);
3. hard-link it under the final name. ``link`` is atomic and fails if the name exists, so a
   file that appeared in the meantime is never replaced: the next free ``name_<n>.ext`` is
   taken instead (``unique_path``, with a warning). Where hard links are not supported, an
   atomic ``rename`` to the free name is used.
4. remove the temporary name.

A crash leaves at most a hidden ``.partial`` file, never a truncated file under a real name.
An explicit overwrite (``replace=True``, e.g. ``--overwrite`` flags) atomically renames over
the old file instead.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def unique_path(path: Path) -> Path:
    """``path`` if free, else the first free ``stem_<n>suffix`` (with a warning)."""
    if not path.exists():
        return path
    n = 1
    while (candidate := path.with_name(f"{path.stem}_{n}{path.suffix}")).exists():
        n += 1
    log.warning("%s exists; writing %s instead", path, candidate.name)
    return candidate


def partial_path(path: Path) -> Path:
    """The hidden temporary name ``path`` is written under before it is published."""
    return path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")


def write_file(path: Path, write: Callable[[Path], object], replace: bool = False) -> Path:
    """Write a result file crash-safely: ``write(temporary_path)`` fills it, then it appears under
    ``path`` (or the first free ``path_<n>``; with ``replace=True`` exactly ``path``, replacing
    it) in one atomic step. Returns the final path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        write(partial)
        with open(partial, "rb") as handle:
            os.fsync(handle.fileno())
        if replace:
            os.replace(partial, path)
            return path
        return _publish_without_replacing(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _publish_without_replacing(partial: Path, path: Path) -> Path:
    while True:
        final = unique_path(path)
        try:
            os.link(partial, final)
            return final
        except FileExistsError:  # someone took the name between the check and the link
            continue
        except OSError:  # no hard links here: a rename to the free name is still atomic
            os.replace(partial, final)
            return final


def write_text_file(text: str, path: Path, replace: bool = False) -> Path:
    return write_file(path, lambda partial: partial.write_text(text), replace=replace)
