"""Where servelab keeps what it builds for itself."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache for random checkpoints and compiled kernels: ``cache_dir``, else
    ``$SERVELAB_CACHE``, else ``~/.cache/servelab``."""
    return Path(cache_dir or os.environ.get("SERVELAB_CACHE") or Path.home() / ".cache" / "servelab").expanduser()
