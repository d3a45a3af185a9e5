"""Build a test engine with any cache / scheduler option (``LLM(...)`` exposes only the common ones,
e.g. not the contiguous cache's ``reserve``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import LLM
from engine.config import engine_config


def build_engine(ckpt: Path, cache: str, scheduler: str, attention: str = "torch_sdpa",
                 cache_options: dict[str, Any] | None = None, scheduler_options: dict[str, Any] | None = None,
                 seed: int = 0, **performance: Any) -> LLM:
    """``performance``: ``LLM.from_config``'s options (``prepack=False, fused_ops=False`` start fastest)."""
    cfg = engine_config(str(ckpt), cache, scheduler, attention, "cpu", "float32", "random", seed,
                        cache_options=cache_options or {}, scheduler_options=scheduler_options or {})
    return LLM.from_config(cfg, **performance)
