"""Decode step time over a float32 and a bfloat16 KV cache, two engines in one process, steps interleaved.

A decode step reads every running sequence's whole context from the KV cache in each layer: with
many or long sequences those bytes rival the weights' (SmolLM2-135M: 46 KB per token in float32),
and ``kv_cache_dtype=bfloat16`` halves them (docs/decisions.md, decision 21). This is
:mod:`experiments.bench.option_ab` with ``--option kv_cache_dtype --values model bfloat16``: the
engine twice with the options ``run.py`` and ``serve.py`` apply apart from the cache, the same
prompts prefilled into each, their greedy decode steps timed alternately; printed: the median
step of each and the ratio, per shape.

    python -m experiments.bench.kv_cache_dtype --shapes 32x128 8x1024 --steps 30
"""
from __future__ import annotations

import argparse

from experiments.bench.option_ab import compare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["32x128", "8x1024"],
                        help="running sequences x prompt tokens, e.g. 32x128")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per engine and shape")
    args = parser.parse_args(argv)
    compare("kv_cache_dtype", ["model", "bfloat16"], args.shapes, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
