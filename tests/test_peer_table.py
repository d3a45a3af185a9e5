"""The peer benchmark's table: medians over interleaved repeats, ratios of medians, failures kept."""
from __future__ import annotations

import pandas as pd
import pytest

from experiments.peer_table import peer_table


def run(engine: str, concurrency: int, tok_s: float, ttft_p50: float, status: str = "ok") -> dict:
    return {"status": status, "engine": engine, "concurrency": concurrency, "output_throughput": tok_s,
            "ttft_s_p50": ttft_p50, "ttft_s_p99": 2 * ttft_p50}


def test_medians_over_repeats_and_ratios_of_medians():
    frame = pd.DataFrame([
        run("servelab", 8, 100.0, 1.0), run("hf_continuous", 8, 30.0, 4.0), run("hf_static", 8, 50.0, 8.0),
        run("servelab", 8, 130.0, 3.0), run("hf_continuous", 8, 40.0, 2.0), run("hf_static", 8, 40.0, 6.0),
        run("servelab", 8, 90.0, 2.0), run("hf_continuous", 8, 60.0, 3.0), run("hf_static", 8, 45.0, 7.0),
        run("servelab", 32, 200.0, 5.0), run("hf_continuous", 32, 0.0, 0.0, status="failed"),
    ])
    table = peer_table(frame)
    ours = table[(table.concurrency == 8) & (table.engine == "servelab")].iloc[0]
    assert ours["runs"] == 3 and ours["output tok/s"] == 100.0 and ours["TTFT p50 (s)"] == 2.0
    assert ours["tok/s range"] == "90.0-130.0"
    peer = table[(table.concurrency == 8) & (table.engine == "hf_continuous")].iloc[0]
    assert peer["output tok/s"] == 40.0  # median of 30, 40, 60
    assert peer["servelab / this tok/s"] == pytest.approx(100.0 / 40.0)
    assert peer["servelab / this TTFT p50"] == pytest.approx(2.0 / 3.0)
    assert list(table[table.concurrency == 8].engine) == ["servelab", "hf_continuous", "hf_static"]
    failed = table[table["output tok/s"] == "failed"]
    assert list(failed.engine) == ["hf_continuous"] and list(failed.concurrency) == [32]
