"""Build a test engine with any cache / scheduler option (``LLM(...)`` exposes only the common ones,
e.g. not the contiguous cache's ``reserve``), and run tiny-model tests on one thread."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM
from engine.config import engine_config


def build_engine(ckpt: Path, cache: str, scheduler: str, attention: str = "torch_sdpa",
                 cache_options: dict[str, Any] | None = None, scheduler_options: dict[str, Any] | None = None,
                 seed: int = 0, **performance: Any) -> LLM:
    """``performance``: ``LLM.from_config``'s options (``prepack=False, fused_ops=False`` start fastest)."""
    cfg = engine_config(str(ckpt), cache, scheduler, attention, "cpu", "float32", "random", seed,
                        cache_options=cache_options or {}, scheduler_options=scheduler_options or {})
    return LLM.from_config(cfg, **performance)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny-model steps are microseconds of math: on a shared 2-core machine a second intra-op
    thread only adds synchronisation (measured 3-7x slower per step under load). Import it into
    a test module and use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
