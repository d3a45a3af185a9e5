"""``experiments.calibration.validation``'s comparison: real vs simulated per case, on the median of repeated real runs."""
from __future__ import annotations

import pandas as pd
import pytest

from experiments.calibration.validation import CASE_COLUMN, comparison, medians


def job(case: str, engine: str, tpot: float, status: str = "ok") -> dict:
    return {CASE_COLUMN: case, "engine": engine, "status": status, "output_throughput": 100.0, "tpot_s_p50": tpot,
            "ttft_s_p50": 0.5, "ttft_s_p99": 1.0, "e2e_s_p50": 2.0, "preemptions": 0, "prefix_hit_tokens": 0}


def test_repeats_are_compared_on_the_median_real_run():
    frame = pd.DataFrame([job("a", "servelab", 0.030), job("a", "simulated", 0.031),
                          job("a", "servelab", 0.040), job("a", "simulated", 0.031),  # one disturbed repeat
                          job("a", "servelab", 0.031), job("a", "simulated", 0.031)])
    table = comparison(frame).set_index("metric")
    assert table.loc["TPOT p50", "real"] == pytest.approx(0.031) and table.loc["TPOT p50", "relative_error"] == 0
    assert table.loc["TPOT p50", "real_spread"] == pytest.approx(0.010 / 0.031)
    assert table.loc["TPOT p50", "note"] == "median of 3 real runs"
    assert medians(comparison(frame)).set_index("metric").loc["TPOT p50", "met"]


def test_one_run_each_and_a_failed_case():
    frame = pd.DataFrame([job("a", "servelab", 0.030), job("a", "simulated", 0.033),
                          job("b", "servelab", 0.030), job("b", "simulated", 0.030, status="failed")])
    table = comparison(frame)
    a = table[table.configuration == "a"].set_index("metric")
    assert a.loc["TPOT p50", "relative_error"] == pytest.approx(0.1) and a.loc["TPOT p50", "real_spread"] == 0
    assert a.loc["TPOT p50", "note"] == ""
    assert table[table.configuration == "b"].note.tolist() == ["a job failed: no comparison"]
