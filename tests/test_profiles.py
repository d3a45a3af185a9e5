"""Load profiles: which levels each profile runs, that max_goodput's bisection converges, that
early stop fires on a saturating run, that a failed anchor stops the series, that bad profile
configs are refused by field; each profile end to end on engine=simulated through execute()."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from experiments.harness.job import execute
from experiments.harness.load_levels import LoadLevel
from experiments.harness.profile_run import build_profile, run_profile
from experiments.harness.profiles import (
    ConcurrencySweep, MaxGoodput, RateSweep, Series, concurrency_levels, littles_law_concurrency,
)
from experiments.harness.records import RequestRecord
from experiments.harness.saturation import SaturationRule
from experiments.results.profile_table import profile_frame
from tests.harness_runs import SIMULATED_TINY, choices_of, compose_config

ROOT = Path(__file__).resolve().parents[1]
#: a small token-id workload on the simulated H100 (tiny model: no tokenizer, so no text prompts)
SIM_RANDOM = [*SIMULATED_TINY, "workload=random", "workload.prompt_format=token_ids", "workload.num_prompts=24",
              "workload.input_len=64", "workload.output_len=16"]


class FakeServer:
    """An ``ExecuteLevel`` with known behaviour: the synchronous run completes ``sync_rate`` req/s,
    the throughput run ``capacity``; a rate level achieves its rate; a request meets the SLOs
    while the rate is at most ``slo_limit``; runs above ``saturates_above`` are saturated."""

    def __init__(self, sync_rate: float = 2.0, capacity: float = 10.0, slo_limit: float = math.inf,
                 saturates_above: float = math.inf, fail: str | None = None) -> None:
        self.sync_rate, self.capacity, self.slo_limit = sync_rate, capacity, slo_limit
        self.saturates_above, self.fail = saturates_above, fail
        self.levels: list[LoadLevel] = []

    def __call__(self, level: LoadLevel, folder: Path, saturation: SaturationRule) -> dict[str, Any]:
        self.levels.append(level)
        if level.phase == self.fail:
            return {"status": "failed", "error": "RuntimeError: the server died", "metrics": {}}
        if level.phase == "synchronous":
            rate, e2e = self.sync_rate, 1.0 / self.sync_rate
        elif level.phase == "throughput" or (level.rate is not None and math.isinf(level.rate)):
            rate, e2e = self.capacity, 1.0
        else:
            rate, e2e = level.rate, 0.5
        share = 1.0 if rate <= self.slo_limit else 0.5
        return {"status": "ok", "error": None,
                "metrics": {"request_throughput": rate, "e2e_s_mean": e2e, "num_requests": 20,
                            "num_good_requests": 20 * share, "goodput": rate * share},
                "saturated": "queue grew" if rate > self.saturates_above else None}


def series_of(fake: FakeServer, tmp_path: Path) -> Series:
    return Series(tmp_path, fake, SaturationRule())


def test_rate_sweep_runs_anchors_then_evenly_spaced_rates_strictly_between_them(tmp_path: Path) -> None:
    fake = FakeServer(sync_rate=2.0, capacity=10.0)
    series = series_of(fake, tmp_path)
    RateSweep(num_rates=3, arrival="constant").run_series(series)
    assert [level.phase for level in fake.levels] == ["synchronous", "throughput", "rate", "rate", "rate"]
    assert fake.levels[0].concurrency == 1 and math.isinf(fake.levels[0].rate)
    assert fake.levels[1].concurrency is None and math.isinf(fake.levels[1].rate)
    assert [level.rate for level in fake.levels[2:]] == pytest.approx([4.0, 6.0, 8.0])
    assert all(level.arrival == "constant" for level in fake.levels[2:])
    assert [run.folder.name for run in series.runs] == ["00-synchronous", "01-throughput", "02-rate-4", "03-rate-6",
                                                        "04-rate-8"]
    assert series.stopped is None and not series.failed


def test_concurrency_sweep_picks_caps_by_littles_law(tmp_path: Path) -> None:
    # synchronous: 2 req/s x 0.5 s = 1 in flight; throughput: 10 req/s x 1 s = 10 in flight
    fake = FakeServer(sync_rate=2.0, capacity=10.0)
    series = series_of(fake, tmp_path)
    ConcurrencySweep(num_levels=3).run_series(series)
    assert series.result["synchronous_concurrency"] == pytest.approx(1.0)
    assert series.result["throughput_concurrency"] == pytest.approx(10.0)
    caps = [level.concurrency for level in fake.levels[2:]]
    assert caps == [3, 6, 8]  # 3.25, 5.5, 7.75 rounded
    assert all(level.phase == "concurrency" and math.isinf(level.rate) for level in fake.levels[2:])


def test_concurrency_levels_drop_duplicates_and_the_synchronous_cap() -> None:
    assert concurrency_levels(0.9, 2.5, 3) == [2]          # 1.3, 1.7, 2.1 -> 1 (the synchronous run), 2, 2
    assert concurrency_levels(1.0, 1.6, 4) == []            # no whole cap strictly between
    assert concurrency_levels(1.0, 9.0, 3) == [3, 5, 7]


@pytest.mark.parametrize("threshold", [3.3, 7.3, 9.9])
def test_max_goodput_bisection_converges_on_the_known_threshold(tmp_path: Path, threshold: float) -> None:
    fake = FakeServer(sync_rate=2.0, capacity=20.0, slo_limit=threshold)
    series = series_of(fake, tmp_path)
    profile = MaxGoodput(slo={"ttft_s": 1.0}, min_share=0.9, tolerance=0.02, max_probes=12)
    profile.run_series(series)
    found, (low, high) = series.result["max_goodput_rate"], series.result["bracket"]
    assert series.result["converged"] and series.stopped is None
    assert low == found <= threshold < high and high - low <= 0.02 * high
    probes = [run for run in series.runs if run.level.phase == "probe"]
    assert probes[0].level.rate == 20.0  # the bracket's top first
    assert len(probes) == series.result["probes"] <= 12
    for run in probes:  # each probe's verdict is what the known threshold says
        assert run.verdict == ("meets" if run.level.rate <= threshold else "misses")
    assert series.result["best_run"] == max((r for r in probes if r.verdict == "meets"), key=lambda r: r.level.rate).folder.name


def test_max_goodput_when_the_top_rate_meets_stops_after_one_probe(tmp_path: Path) -> None:
    fake = FakeServer(sync_rate=2.0, capacity=20.0)
    series = series_of(fake, tmp_path)
    MaxGoodput(slo={"ttft_s": 1.0}).run_series(series)
    assert series.result["max_goodput_rate"] == 20.0 and series.result["probes"] == 1 and series.result["converged"]


def test_max_goodput_records_max_probes_reached(tmp_path: Path) -> None:
    series = series_of(FakeServer(capacity=20.0, slo_limit=7.3), tmp_path)
    MaxGoodput(slo={"ttft_s": 1.0}, tolerance=0.001, max_probes=3).run_series(series)
    assert not series.result["converged"] and "max_probes (3)" in series.stopped
    assert series.result["max_goodput_rate"] == 5.0  # probes 20 (misses), 10 (misses), 5 (meets)


def test_early_stop_skips_the_levels_above_the_first_saturated_run(tmp_path: Path) -> None:
    fake = FakeServer(sync_rate=2.0, capacity=12.0, saturates_above=5.0)
    series = series_of(fake, tmp_path)
    RateSweep(num_rates=4).run_series(series)  # 4, 6, 8, 10: saturated at 6
    assert [level.rate for level in fake.levels[2:]] == pytest.approx([4.0, 6.0])
    assert [level.rate for level in series.skipped] == pytest.approx([8.0, 10.0])
    assert series.stopped.startswith("saturated at rate-6") and not series.failed
    table = profile_frame(series)  # the skipped levels are in the table, with the reason
    skipped = table[table["status"] == "skipped"]
    assert list(skipped["target_rate"]) == pytest.approx([8.0, 10.0])
    assert all(note.startswith("saturated at rate-6: queue grew") for note in skipped["note"])
    assert list(table["saturated"].fillna("")) == ["", "queue grew", "", "queue grew", "", ""]
    series_off = series_of(FakeServer(capacity=12.0, saturates_above=5.0), tmp_path / "off")
    RateSweep(num_rates=4, early_stop=False).run_series(series_off)
    assert len(series_off.runs) == 6 and not series_off.skipped


@pytest.mark.parametrize("failing, runs", [("synchronous", 1), ("throughput", 2)])
def test_a_failed_anchor_stops_the_series_with_the_run_recorded(tmp_path: Path, failing: str, runs: int) -> None:
    for profile in (RateSweep(), ConcurrencySweep(), MaxGoodput(slo={"ttft_s": 1.0})):
        series = series_of(FakeServer(fail=failing), tmp_path / profile.name)
        profile.run_series(series)
        assert series.failed and len(series.runs) == runs and series.runs[-1].failed
        assert failing in series.stopped and "the server died" in series.stopped
        assert "max_goodput_rate" not in series.result


def _record(arrival: float, ttft: float) -> RequestRecord:
    return RequestRecord(request_id=f"r{arrival}", engine_request_id="0", prompt_tokens=8, output_tokens=4,
                         arrival_s=arrival, submit_s=arrival, first_scheduled_s=arrival,
                         first_token_s=arrival + ttft, finish_s=arrival + ttft + 0.1)


def test_saturation_rule_sees_a_ttft_trend_and_a_growing_queue() -> None:
    rule = SaturationRule()
    growing = [_record(i * 0.1, 0.05 + 0.05 * i) for i in range(16)]       # the queue builds: TTFT climbs
    steady = [_record(i * 0.1, 0.06 + 0.001 * (i % 3)) for i in range(16)]  # keeps up
    assert "TTFT grew" in rule.check(growing, [])
    assert rule.check(steady, []) is None
    assert rule.check(growing[:6], []) is None  # too few requests to tell
    queue = [{"start_time": t * 0.05, "num_waiting": int(t * 0.05 * 4)} for t in range(32)]  # 0 -> 6 waiting
    assert "waiting queue grew" in rule.check(steady, queue)
    flat = [{"start_time": t * 0.05, "num_waiting": 2} for t in range(32)]
    assert rule.check(steady, flat) is None


def test_saturation_fires_on_a_simulated_server_pushed_past_its_capacity(tmp_path: Path) -> None:
    overrides = [*SIM_RANDOM, "workload.num_prompts=48"]
    cfg = compose_config(overrides)
    rule = SaturationRule()
    capacity = execute(cfg, tmp_path / "t", choices_of(overrides), overrides,
                       load=LoadLevel("throughput", rate=math.inf)).summary["metrics"]["request_throughput"]
    over = execute(cfg, tmp_path / "over", choices_of(overrides), overrides,
                   load=LoadLevel("rate", rate=4 * capacity, arrival="constant"), saturation=rule).summary
    under = execute(cfg, tmp_path / "under", choices_of(overrides), overrides,
                    load=LoadLevel("rate", rate=0.1 * capacity, arrival="constant"), saturation=rule).summary
    assert over["saturated"] and under["saturated"] is None
    assert under["load"] == {"phase": "rate", "rate": pytest.approx(0.1 * capacity), "concurrency": None,
                             "arrival": "constant", "all_at_once": False}


def test_load_level_retimes_the_workload() -> None:
    from experiments.harness.workloads import burst

    requests = burst(512, (0, 1, 2), concurrency=4, seed=0)
    constant = LoadLevel("rate", rate=4.0, arrival="constant").apply(requests, seed=0)
    assert [r.arrival_offset_s for r in constant] == [i / 4.0 for i in range(len(requests))]
    assert [r.prompt_token_ids for r in constant] == [r.prompt_token_ids for r in requests]
    poisson = LoadLevel("rate", rate=4.0).apply(requests, seed=0)
    gaps = [b.arrival_offset_s - a.arrival_offset_s for a, b in zip(poisson, poisson[1:])]
    assert poisson[0].arrival_offset_s == 0.0 and all(g > 0 for g in gaps) and len(set(gaps)) == len(gaps)
    assert all(r.arrival_offset_s == 0 for r in LoadLevel("throughput", rate=math.inf).apply(requests, seed=0))
    assert LoadLevel("probe", rate=1.25).label == "probe-1.25" and LoadLevel("concurrency", math.inf, 8).label == "concurrency-8"


@pytest.mark.parametrize("overrides, field", [
    (["profile=rate_sweep", "profile.num_rates=0"], "profile.num_rates"),
    (["profile=rate_sweep", "profile.arrival=gamma"], "profile.arrival"),
    (["profile=concurrency_sweep", "profile.num_levels=0"], "profile.num_levels"),
    (["profile=max_goodput", "profile.min_share=0"], "profile.min_share"),
    (["profile=max_goodput", "profile.min_share=1.5"], "profile.min_share"),
    (["profile=max_goodput", "profile.max_probes=0"], "profile.max_probes"),
    (["profile=max_goodput", "slo.ttft_s=null", "slo.tpot_s=null", "slo.e2e_s=null"], "slo.ttft_s"),
    (["profile=rate_sweep", "profile.saturation.ttft_growth=1"], "profile.saturation.ttft_growth"),
])
def test_bad_profile_config_is_refused_naming_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build_profile(compose_config(overrides))


def test_fixed_is_the_default_profile() -> None:
    assert build_profile(compose_config([])).name == "fixed"


def _run_series(overrides: list[str], out: Path):
    cfg = compose_config(overrides)
    return run_profile(cfg, build_profile(cfg), out, choices_of(overrides), overrides)


def test_rate_sweep_on_the_simulator_writes_one_table_over_numbered_runs(tmp_path: Path) -> None:
    series = _run_series([*SIM_RANDOM, "profile=rate_sweep", "profile.num_rates=3", "profile.early_stop=false"], tmp_path)
    low, high = series.result["synchronous_rate"], series.result["throughput_rate"]
    rates = [run.level.rate for run in series.runs[2:]]
    assert len(rates) == 3 and low < rates[0] < rates[1] < rates[2] < high
    assert rates[1] - rates[0] == pytest.approx(rates[2] - rates[1]) == pytest.approx((high - low) / 4)
    for run in series.runs:
        summary = json.loads((run.folder / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["load"]["phase"] == run.level.phase
        assert (run.folder / "requests.csv").is_file() and (run.folder / "config.yaml").is_file()
    table = pd.read_csv(tmp_path / "profile.csv")
    assert list(table["run"]) == [run.folder.name for run in series.runs]
    assert table["request_throughput"].iloc[0] == pytest.approx(low)
    document = json.loads((tmp_path / "profile.json").read_text())
    assert document["profile"] == "rate_sweep" and document["result"]["throughput_rate"] == pytest.approx(high)
    assert "| 00-synchronous | synchronous |" in (tmp_path / "profile.md").read_text()


def test_concurrency_sweep_on_the_simulator_uses_the_anchors_littles_law(tmp_path: Path) -> None:
    series = _run_series([*SIM_RANDOM, "workload.num_prompts=32", "profile=concurrency_sweep", "profile.num_levels=3",
                          "profile.early_stop=false"], tmp_path)
    synchronous, throughput = series.runs[:2]
    expected = concurrency_levels(littles_law_concurrency(synchronous), littles_law_concurrency(throughput), 3)
    assert expected and [run.level.concurrency for run in series.runs[2:]] == expected
    peak = [json.loads((run.folder / "summary.json").read_text())["metrics"]["max_running_seqs"] for run in series.runs[2:]]
    assert all(p <= cap for p, cap in zip(peak, expected))  # the client-side cap held


def test_max_goodput_on_the_simulator_reports_every_probe(tmp_path: Path) -> None:
    series = _run_series([*SIM_RANDOM, "workload.num_prompts=32", "profile=max_goodput", "slo.ttft_s=0.004",
                          "slo.tpot_s=null", "profile.tolerance=0.1"], tmp_path)
    probes = [run for run in series.runs if run.level.phase == "probe"]
    assert probes and all(run.verdict in ("meets", "misses") for run in probes)
    best = series.result["max_goodput_rate"]
    assert best is not None and all(run.level.rate <= best for run in probes if run.verdict == "meets")
    assert all(run.slo_share >= 0.9 for run in probes if run.verdict == "meets")
    assert all(run.slo_share < 0.9 for run in probes if run.verdict == "misses")
    table = pd.read_csv(tmp_path / "profile.csv")
    assert list(table.loc[table["phase"] == "probe", "verdict"]) == [run.verdict for run in probes]


def test_run_py_profile_writes_series_table_plots_and_page_and_exits_nonzero_on_a_failed_anchor(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ok = subprocess.run([sys.executable, "run.py", *SIM_RANDOM, "plots=true", "workload.num_prompts=16",
                         "profile=rate_sweep", "profile.num_rates=1", f"hydra.run.dir={tmp_path / 'ok'}"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-3000:]
    names = {p.name for p in (tmp_path / "ok").iterdir()}
    assert {"00-synchronous", "01-throughput", "profile.md", "profile.csv", "profile.json",
            "latency_vs_rate.png", "goodput_vs_rate.png", "report.html"} <= names
    assert any(name.startswith("02-rate-") for name in names) and "# servelab load profile: rate_sweep" in ok.stdout
    # the tiny model has no tokenizer, so text prompts fail the synchronous run
    failed = subprocess.run([sys.executable, "run.py", *SIM_RANDOM, "workload.prompt_format=text", "profile=rate_sweep",
                             f"hydra.run.dir={tmp_path / 'failed'}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert failed.returncode != 0
    assert json.loads((tmp_path / "failed" / "00-synchronous" / "summary.json").read_text())["status"] == "failed"
    document = json.loads((tmp_path / "failed" / "profile.json").read_text())
    assert document["failed"] and [row["status"] for row in document["runs"]] == ["failed", "skipped"]
