"""Simulated steps are counted against the ranges a calibration covered, and a run that leaves
them too far is said to (summary.json, summary.md, a console warning) or, strict, refused."""
from __future__ import annotations

import json
import logging
import math

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from engine.config import CONF_DIR
from engine.step_shape import StepShape
from simulator.extrapolation import ExtrapolationCount, ExtrapolationLimits
from simulator.feature_ranges import FEATURES, FeatureRange, parse_ranges, step_features
from simulator.hardware import Hardware

#: one step inside, one step beyond every feature of it (each feature 3x or more)
INSIDE = StepShape(num_seqs=4, num_rows=64, num_decode_tokens=4, num_wasted_slots=0, num_sampled=5,
                   context_tokens=400, prefill_attention_pairs=1830, padded_attention_pairs=3600,
                   shared_context_tokens=64)
OUTSIDE = StepShape(num_seqs=12, num_rows=192, num_decode_tokens=12, num_wasted_slots=0, num_sampled=13,
                    context_tokens=4000, prefill_attention_pairs=16290, padded_attention_pairs=32400,
                    shared_context_tokens=640)
WIDE = FeatureRange(0.0, 1e12)


def counter(ranges: dict[str, FeatureRange], **limits) -> ExtrapolationCount:
    return ExtrapolationCount("cal", ranges, "padded", ExtrapolationLimits(**limits))


@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_step_outside_one_range_is_counted_with_its_ratio(feature):
    """With only ``feature``'s range tight (exactly the inside step's value), the inside step is not
    counted, the outside step is, against that feature alone, by the ratio of the two values."""
    inside, outside = step_features(INSIDE, "padded")[feature], step_features(OUTSIDE, "padded")[feature]
    ranges = {name: WIDE for name in FEATURES} | {feature: FeatureRange(inside, inside)}
    count = counter(ranges)
    count.observe(INSIDE)
    assert count.steps_outside == 0
    count.observe(OUTSIDE)
    assert (count.steps, count.steps_outside) == (2, 1)
    excess = count.features[feature]
    assert excess.steps_outside == 1 and excess.max_ratio == pytest.approx(outside / inside) and outside / inside >= 3
    assert all(count.features[name].steps_outside == 0 for name in FEATURES if name != feature)
    report = count.report()
    assert report["status"] == "extrapolates"  # half the steps outside, 3x beyond
    assert report["features"][feature]["worst_value"] == outside


def test_below_a_range_and_never_seen_values():
    """A value under the range counts by min / value; a shared context the calibration never had
    (its range [0, 0]) is beyond it without bound and reported as never seen."""
    ranges = {name: WIDE for name in FEATURES} | {"sequences": FeatureRange(8, 16),
                                                  "shared_context_tokens": FeatureRange(0, 0)}
    count = counter(ranges)
    count.observe(INSIDE)  # 4 sequences, 64 shared tokens
    assert count.features["sequences"].max_ratio == pytest.approx(2.0)
    assert math.isinf(count.features["shared_context_tokens"].max_ratio)
    assert count.report()["features"]["shared_context_tokens"]["max_ratio"] is None
    assert any("never seen" in reason for reason in count.too_far())


def test_thresholds_warn_and_strict_refuses(caplog):
    """Over 10% of steps outside warns at the end of the run; strict refuses then, and refuses at
    once a step beyond 2x of a range, naming the feature, its value and the range."""
    tight = {name: FeatureRange(value, value) for name, value in step_features(INSIDE, "padded").items()}
    slightly = {name: FeatureRange(r.low, r.high) for name, r in tight.items()} | {
        "batch_rows": FeatureRange(1, 50), "prefill_tokens": FeatureRange(0, 60)}  # INSIDE's 64 rows: 1.28x beyond
    share = counter(slightly)
    for _ in range(8):
        share.observe(StepShape(**{**INSIDE.__dict__, "num_rows": 50}))
    share.observe(INSIDE)  # 1 of 9 steps outside: 11% > 10%
    with caplog.at_level(logging.WARNING, logger="simulator.extrapolation"):
        share.enforce()
    assert "1 of 9 steps (11%) lie outside" in caplog.text
    strict_share = counter(slightly, strict=True)
    for _ in range(9):
        strict_share.observe(StepShape(**{**INSIDE.__dict__, "num_rows": 50}))
    strict_share.observe(INSIDE)  # 1 of 10: not over 10%
    strict_share.enforce()
    strict_share.observe(INSIDE)  # 2 of 11
    with pytest.raises(ValueError, match="simulator.strict: .*2 of 11 steps"):
        strict_share.enforce()
    strict = counter(tight, strict=True)
    strict.observe(INSIDE)
    strict.raise_refusal()
    strict.observe(OUTSIDE)
    with pytest.raises(ValueError, match=r"step 2 has sequences = 12, 3x beyond the range \[4, 4\]"):
        strict.raise_refusal()


def test_presets_and_older_calibrations_are_not_counted():
    """A datasheet preset says "projected, uncalibrated"; a calibration without ranges says the
    extrapolation is unknown; neither warns or refuses."""
    preset = ExtrapolationCount.for_hardware(Hardware(name="p", peak_tflops=1, bandwidth_tbps=1),
                                             ExtrapolationLimits(strict=True))
    preset.observe(OUTSIDE)
    preset.enforce()
    assert preset.report()["status"] == "projected, uncalibrated" and preset.report()["features"] is None
    older = ExtrapolationCount.for_hardware(Hardware(name="o", peak_tflops=1, bandwidth_tbps=1, calibrated=True))
    assert older.report()["status"].startswith("unknown")


def test_hardware_file_ranges_are_checked():
    """feature_ranges must name every feature with 0 <= min <= max; the error names the field."""
    good = {name: [0, 10] for name in FEATURES}
    assert parse_ranges(good, "hw")["batch_rows"] == FeatureRange(0.0, 10.0)
    with pytest.raises(ValueError, match="lacks \\['sequences'\\]"):
        parse_ranges({k: v for k, v in good.items() if k != "sequences"}, "hw")
    with pytest.raises(ValueError, match="feature_ranges.batch_rows must have 0 <= min <= max"):
        Hardware(name="x", peak_tflops=1, bandwidth_tbps=1, feature_ranges=good | {"batch_rows": [5, 1]})


def test_a_run_reports_its_extrapolation_and_strict_refuses_it(tmp_path):
    """engine=simulated on a calibration whose ranges the run leaves writes the count into
    summary.json and summary.md; with simulator.strict=true the same run fails with the feature named."""
    from experiments.harness.job import execute

    overrides = ["engine=simulated", "model=tiny", "workload=burst", "workload.concurrency=4", "driver.progress=false",
                 "plots=false", "hardware=h200"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        strict_cfg = compose("config", overrides=[*overrides, "simulator.strict=true"])
    narrow = {name: [0, 1e9] for name in FEATURES} | {"batch_rows": [1, 2]}  # the burst's prefills are longer
    for c in (cfg, strict_cfg):
        c.hardware = OmegaConf.create({"_target_": "simulator.hardware.Hardware", "name": "narrow", "peak_tflops": 1,
                                       "bandwidth_tbps": 1, "calibrated": True, "calibrated_model": "tiny",
                                       "feature_ranges": narrow})
    outcome = execute(cfg, tmp_path / "lenient", {"engine": "simulated", "hardware": "narrow"}, [])
    assert not outcome.failed
    report = json.loads((tmp_path / "lenient" / "summary.json").read_text())["simulation"]["extrapolation"]
    assert report["status"] == "extrapolates" and 0 < report["steps_outside"] < report["steps"]
    assert report["features"]["batch_rows"]["steps_outside"] == report["steps_outside"]
    assert "**Calibrated ranges**: extrapolates" in (tmp_path / "lenient" / "summary.md").read_text()
    refused = execute(strict_cfg, tmp_path / "strict", {"engine": "simulated", "hardware": "narrow"}, [])
    assert refused.failed and "simulator.strict: step " in refused.summary["error"]
    assert "batch_rows" in refused.summary["error"] and "range [1, 2]" in refused.summary["error"]
