"""The in-process vs HTTP table: medians over repeats per configuration, and the ratios."""
from __future__ import annotations

import pandas as pd
import pytest

from experiments.bench.http_overhead import overhead_table


def run(engine: str, cache: str, repeat: int, tok_s: float, ttft: float) -> dict:
    return {"status": "ok", "engine": engine, "cache": cache, "concurrency": 32, "override:repeat": str(repeat),
            "output_throughput": tok_s, "ttft_s_p50": ttft, "ttft_s_p99": 2 * ttft}


def test_medians_per_configuration_and_ratios() -> None:
    frame = pd.DataFrame([
        run("servelab", "paged", 0, 100.0, 1.0), run("servelab_http", "paged", 0, 90.0, 1.2),
        run("servelab", "paged", 1, 120.0, 3.0), run("servelab_http", "paged", 1, 99.0, 1.0),
        run("servelab", "paged", 2, 80.0, 2.0), run("servelab_http", "paged", 2, 95.0, 1.1),
        run("servelab", "prefix", 0, 50.0, 0.5), run("servelab_http", "prefix", 0, 25.0, 1.0),
        {**run("servelab_http", "prefix", 1, 0.0, 0.0), "status": "failed"},
    ])
    table = overhead_table(frame).set_index("cache")
    assert table.at["paged", "in-process runs"] == 3 and table.at["paged", "HTTP runs"] == 3
    assert table.at["paged", "in-process tok/s"] == 100.0 and table.at["paged", "HTTP tok/s"] == 95.0
    assert table.at["paged", "HTTP / in-process tok/s"] == pytest.approx(0.95)
    assert table.at["paged", "HTTP / in-process TTFT p50"] == pytest.approx(1.1 / 2.0)
    assert table.at["prefix", "HTTP runs"] == 1  # the failed run is left out
    assert table.at["prefix", "HTTP / in-process tok/s"] == pytest.approx(0.5)
