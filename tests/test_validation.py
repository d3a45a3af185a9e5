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


def write_job(folder, case: str, engine: str, tpot: float, extrapolation: dict | None = None) -> None:
    import json

    folder.mkdir(parents=True)
    row = job(case, engine, tpot)
    summary = {"status": "ok", "run": {"engine": engine, "hardware": "cal" if engine == "simulated" else None},
               "metrics": {k: v for k, v in row.items() if k not in (CASE_COLUMN, "engine", "status")}}
    if extrapolation is not None:
        summary["simulation"] = {"timing": "simulated", "extrapolation": extrapolation}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "overrides.yaml").write_text(f"- +validation_case={case}\n- engine={engine}\n")


def test_calibrations_are_compared_on_the_same_cases_with_their_extrapolation(tmp_path):
    """calibrations.md gives each calibration's median error and the cases it flagged, and per case
    which feature lay furthest outside the calibrated range."""
    from experiments.calibration.validation import compare_calibrations

    far = {"status": "extrapolates", "share_outside": 0.4, "features": {
        "batch_rows": {"range": [1, 16], "steps_outside": 3, "max_ratio": 2.5, "worst_value": 40},
        "shared_context_tokens": {"range": [0, 0], "steps_outside": 4, "max_ratio": None, "worst_value": 64}}}
    inside = {"status": "within ranges", "share_outside": 0.0, "features": {
        "batch_rows": {"range": [1, 64], "steps_outside": 0, "max_ratio": 1.0, "worst_value": None}}}
    for name, sim_tpot, report in (("suite", 0.031, inside), ("one-run", 0.045, far)):
        write_job(tmp_path / name / "0", "a", "servelab", 0.030)
        write_job(tmp_path / name / "1", "a", "simulated", sim_tpot, report)
    text = compare_calibrations({"suite": tmp_path / "suite", "one-run": tmp_path / "one-run"}, tmp_path).read_text()
    lines = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "0 of 1" in lines["suite"] and "1 of 1" in lines["one-run"]
    assert "0.5" in lines["one-run"] and "0.03333" in lines["suite"]  # TPOT: |0.045 / 0.030 - 1|, |0.031 / 0.030 - 1|
    assert "shared_context_tokens never seen" in text and "within ranges" in text
