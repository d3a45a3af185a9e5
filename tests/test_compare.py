"""python -m experiments.compare: B/A ratios of two runs, sweeps paired by their swept overrides,
and a clear error naming the folder for input that is not a run or a sweep."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.results.compare import compare, load_side, main
from tests.result_folders import metrics, write_run, write_sweep

ROOT = Path(__file__).resolve().parents[1]


def test_two_runs_side_by_side_with_ratios(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", {"output_throughput": 100.0, "ttft_s_p50": 0.5, "goodput": 2.0,
                                   "prefix_hit_tokens": None}, ["cache=paged"])
    b = write_run(tmp_path / "b", {"output_throughput": 150.0, "ttft_s_p50": 0.25, "goodput": 2.0,
                                   "prefix_hit_tokens": 640}, ["cache=prefix"])
    assert main([str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    table = pd.read_csv(tmp_path / "out" / "compare.csv").set_index("metric")
    assert table.loc["output tok/s", "B/A"] == pytest.approx(1.5) and table.loc["output tok/s", "better"] == "B"
    assert table.loc["TTFT p50 (s)", "B/A"] == pytest.approx(0.5) and table.loc["TTFT p50 (s)", "better"] == "B"
    assert table.loc["goodput (req/s)", "better"] == "same"
    assert pd.isna(table.loc["prefix hit tokens", "B/A"]) and table.loc["prefix hit tokens", "B"] == 640
    assert "TPOT p50 (s)" not in table.index  # neither run has it
    assert "| run | output tok/s | 100 | 150 | 1.5 | B |" in (tmp_path / "out" / "compare.md").read_text()


def test_sweeps_are_paired_by_their_swept_overrides(tmp_path: Path) -> None:
    a = write_sweep(tmp_path / "a", levels=(1, 4, 16), extra=["cache=paged"])
    b = write_sweep(tmp_path / "b", levels=(16, 4, 64), extra=["cache=prefix"], speed=2.0)  # other job order
    result = compare(load_side(a), load_side(b))
    assert result.keys == ["workload.concurrency"]
    throughput = result.table[result.table["metric"] == "output tok/s"].set_index("run")
    assert list(throughput.index) == ["workload.concurrency=4", "workload.concurrency=16"]
    for level in (4, 16):
        row = throughput.loc[f"workload.concurrency={level}"]
        assert row["A"] == pytest.approx(metrics(level)["output_throughput"])
        assert row["B/A"] == pytest.approx(2.0)
    assert result.only_a == ["workload.concurrency=1"] and result.only_b == ["workload.concurrency=64"]


def test_a_failed_run_is_compared_by_its_status(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", {"output_throughput": 10.0}, [])
    b = write_run(tmp_path / "b", {}, [], status="failed")
    table = compare(load_side(a), load_side(b)).table.set_index("metric")
    assert table.loc["status", "A"] == "ok" and table.loc["status", "B"] == "failed"
    assert pd.isna(table.loc["output tok/s", "B"])


def test_a_folder_without_summary_json_is_named_in_the_error(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", {"output_throughput": 1.0}, [])
    (tmp_path / "crashed" / ".hydra").mkdir(parents=True)  # a run that died before writing summary.json
    with pytest.raises(ValueError, match=f"{tmp_path / 'crashed'}: no summary.json"):
        load_side(tmp_path / "crashed")
    with pytest.raises(ValueError, match=f"{tmp_path / 'nowhere'}: no such folder"):
        load_side(tmp_path / "nowhere")
    proc = subprocess.run([sys.executable, "-m", "experiments.compare", str(run), str(tmp_path / "crashed"),
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and f"{tmp_path / 'crashed'}: no summary.json" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_two_sweeps_with_no_run_in_common_are_an_error_naming_both(tmp_path: Path) -> None:
    a = write_sweep(tmp_path / "a", levels=(1, 4))
    b = write_sweep(tmp_path / "b", levels=(8, 32))
    with pytest.raises(ValueError, match=f"no run in common between {a} and {b}.*workload.concurrency=4"):
        compare(load_side(a), load_side(b))


def test_runs_of_one_sweep_with_the_same_label_are_an_error(tmp_path: Path) -> None:
    a = write_sweep(tmp_path / "a", levels=(1, 4))
    write_run(a / "2", metrics(4), ["workload.concurrency=4"])
    with pytest.raises(ValueError, match="jobs 1 and 2 have the same run label"):
        compare(load_side(a), load_side(a))
