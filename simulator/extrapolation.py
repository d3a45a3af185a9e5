"""Extrapolation said out loud: the simulated steps that lie outside what a calibration saw.

A calibrated hardware file records the range of every cost-model feature its steps covered
(:mod:`simulator.feature_ranges`). A simulated run on it passes each step it prices through
:meth:`ExtrapolationCount.observe`, which counts the steps with any feature outside its range
and keeps, per feature, how many steps left the range and the largest ratio beyond it
(``value / max`` above, ``min / value`` below). The run's ``summary.json`` carries the count
(``simulation.extrapolation``) and ``summary.md`` a line and a table of it.

A run **extrapolates too far** when more than ``warn_share`` of its steps (default 10%) lie
outside, or any feature of any step lies beyond ``warn_ratio`` times its range (default 2x):
it warns on the console at the end of the run (:meth:`ExtrapolationCount.enforce`). With
``strict`` (``simulator.strict=true``), such a run is refused with a ``ValueError`` naming the
feature, the value and the range: at the first step beyond ``warn_ratio`` (no time spent on
the rest), or at the end of the run for the share.

Datasheet presets have no ranges: their runs are ``projected, uncalibrated`` as a whole, and the
count says so instead of counting.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.step_shape import StepShape
from simulator.feature_ranges import FEATURES, FeatureRange, step_features
from simulator.hardware import PROJECTED, Hardware

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtrapolationLimits:
    """When a run extrapolates too far (``simulator:`` in conf/config.yaml)."""

    strict: bool = False
    warn_share: float = 0.10
    warn_ratio: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.warn_share <= 1:
            raise ValueError(f"simulator.warn_share must be in [0, 1], got {self.warn_share}")
        if self.warn_ratio < 1:
            raise ValueError(f"simulator.warn_ratio must be >= 1, got {self.warn_ratio}")


@dataclass
class FeatureExcess:
    """One feature's steps outside its range and the worst of them."""

    steps_outside: int = 0
    max_ratio: float = 1.0
    worst_value: float | None = None


@dataclass
class ExtrapolationCount:
    """Counts a run's steps against a hardware file's feature ranges (``None``: nothing to count against)."""

    hardware_name: str
    ranges: Mapping[str, FeatureRange] | None
    attention_pairs: str
    limits: ExtrapolationLimits = field(default_factory=ExtrapolationLimits)
    calibrated: bool = True
    steps: int = 0
    steps_outside: int = 0
    features: dict[str, FeatureExcess] = field(default_factory=lambda: {name: FeatureExcess() for name in FEATURES})
    refusal: str | None = None  # strict: why the run is refused, set by the first step beyond warn_ratio

    @classmethod
    def for_hardware(cls, hardware: Hardware, limits: ExtrapolationLimits | None = None) -> "ExtrapolationCount":
        return cls(hardware.name, hardware.feature_ranges, hardware.attention_pairs,
                   limits or ExtrapolationLimits(), hardware.calibrated)

    def observe(self, shape: StepShape) -> None:
        """Count one priced step; strict: a step beyond ``warn_ratio`` of a range sets :attr:`refusal`
        (:meth:`raise_refusal` raises it outside the engine's step, whose errors fail only the
        step's requests)."""
        self.steps += 1
        if self.ranges is None:
            return
        outside = False
        for name, value in step_features(shape, self.attention_pairs).items():
            ratio = self.ranges[name].ratio_beyond(value)
            if ratio <= 1.0:
                continue
            outside = True
            excess = self.features[name]
            excess.steps_outside += 1
            if ratio > excess.max_ratio:
                excess.max_ratio, excess.worst_value = ratio, value
            if self.limits.strict and ratio > self.limits.warn_ratio and self.refusal is None:
                self.refusal = (f"simulator.strict: step {self.steps} has {name} = {value:g}, "
                                f"{self.describe_ratio(ratio)} the range [{self.ranges[name].low:g}, "
                                f"{self.ranges[name].high:g}] that calibration {self.hardware_name} covered "
                                f"(limit {self.limits.warn_ratio:g}x); calibrate on runs that reach it "
                                "(python -m experiments.calibration.calibrate --suite)")
        self.steps_outside += outside

    def raise_refusal(self) -> None:
        """Strict: raise the refusal a step set (``ValueError``), if any."""
        if self.refusal is not None:
            raise ValueError(self.refusal)

    def reset(self) -> None:
        """Forget the steps counted so far (the untimed warm-up before a measured run)."""
        self.steps = self.steps_outside = 0
        self.refusal = None
        self.features = {name: FeatureExcess() for name in FEATURES}

    @staticmethod
    def describe_ratio(ratio: float) -> str:
        return "far outside (never seen)" if math.isinf(ratio) else f"{ratio:.3g}x beyond"

    @property
    def share_outside(self) -> float:
        return self.steps_outside / self.steps if self.steps else 0.0

    def too_far(self) -> list[str]:
        """Why the run extrapolates too far (empty: it does not): one sentence per reason."""
        if self.ranges is None:
            return []
        reasons = []
        if self.share_outside > self.limits.warn_share:
            reasons.append(f"{self.steps_outside} of {self.steps} steps ({self.share_outside:.0%}) lie outside "
                           f"the calibrated ranges (limit {self.limits.warn_share:.0%})")
        for name, excess in self.features.items():
            if excess.max_ratio > self.limits.warn_ratio:
                r = self.ranges[name]
                reasons.append(f"{name} = {excess.worst_value:g} is {self.describe_ratio(excess.max_ratio)} "
                               f"its range [{r.low:g}, {r.high:g}] (limit {self.limits.warn_ratio:g}x)")
        return reasons

    def report(self) -> dict[str, Any]:
        """What summary.json records (``simulation.extrapolation``); ratios never seen are ``None``."""
        if self.ranges is None:
            status = PROJECTED if not self.calibrated else "unknown: calibrated before ranges were recorded"
            return {"status": status, "steps": self.steps, "steps_outside": None, "share_outside": None,
                    "features": None}
        return {
            "status": "extrapolates" if self.too_far() else ("within ranges" if not self.steps_outside
                                                             else "mostly within ranges"),
            "steps": self.steps, "steps_outside": self.steps_outside, "share_outside": self.share_outside,
            "warn_share": self.limits.warn_share, "warn_ratio": self.limits.warn_ratio,
            "reasons": self.too_far(),
            "features": {name: {"range": [self.ranges[name].low, self.ranges[name].high],
                                "steps_outside": excess.steps_outside,
                                "max_ratio": None if math.isinf(excess.max_ratio) else excess.max_ratio,
                                "worst_value": excess.worst_value}
                         for name, excess in self.features.items()},
        }

    def enforce(self) -> None:
        """At the end of the run: warn if it extrapolates too far; strict: refuse it."""
        reasons = self.too_far()
        if not reasons:
            return
        message = f"the simulation extrapolates beyond calibration {self.hardware_name}: " + "; ".join(reasons)
        if self.limits.strict:
            raise ValueError(f"simulator.strict: {message}")
        log.warning("%s; its times are a projection there (simulator.strict=true refuses such runs)", message)


def extrapolation_markdown(report: Mapping[str, Any] | None) -> list[str]:
    """summary.md's lines for ``simulation.extrapolation`` (none for a run without one)."""
    if not report:
        return []
    if report.get("features") is None:
        return [f"**Calibrated ranges**: {report['status']}; steps are not checked against a calibration.", ""]
    lines = [f"**Calibrated ranges**: {report['status']}: {report['steps_outside']} of {report['steps']} steps "
             f"({report['share_outside']:.1%}) have a feature outside what the calibration covered.", ""]
    lines += [f"- {reason}" for reason in report.get("reasons", [])]
    if report.get("reasons"):
        lines.append("")
    lines += ["| feature | calibrated range | steps outside | max ratio beyond | worst value |",
              "| --- | --- | --- | --- | --- |"]
    for name, f in report["features"].items():
        ratio = "never seen" if f["max_ratio"] is None else f"{f['max_ratio']:.3g}"
        worst = "—" if f["worst_value"] is None else f"{f['worst_value']:g}"
        lines.append(f"| {name} | [{f['range'][0]:g}, {f['range'][1]:g}] | {f['steps_outside']} | {ratio} | {worst} |")
    return [*lines, ""]
