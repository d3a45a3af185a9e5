"""Load profiles: one command runs a series of loads and finds where the server stops keeping up.

A profile (``profile=`` in the config, conf/profile/) decides which :class:`LoadLevel` each run
of the series gets, from what earlier runs measured, the way serving benchmarks do:

* ``fixed``: one run as configured (the workload's own arrivals and cap).
* ``rate_sweep`` (guidellm's ``--profile sweep``): a **synchronous** run (one request at a time),
  a **throughput** run (everything at once: the saturating run), then ``num_rates`` request rates
  evenly spaced strictly between the two measured request rates, ascending, constant or Poisson.
* ``concurrency_sweep`` (``vllm bench sweep serve_workload``): the same two anchors, turned into
  concurrencies by Little's law (requests in flight = request rate x mean E2E), then
  ``num_levels`` client-side caps evenly spaced strictly between them.
* ``max_goodput``: the highest request rate at which at least ``min_share`` of the requests
  meet every SLO (``slo.*``), by bisection on measured runs between 0 and the throughput run's
  rate, until the bracket is within ``tolerance`` of its top or ``max_probes`` runs were made.

Sweeps stop early (``early_stop``) once a run is saturated (:mod:`experiments.harness.saturation`):
the levels above it are recorded as skipped, with the reason. A failed anchor run stops the
profile with that run recorded as failed (and the series as failed). Every run writes its usual
files into a numbered subfolder (``00-synchronous``, ``01-throughput``, ``02-rate-1.5``...);
:mod:`experiments.harness.profile_run` wires a profile to ``execute`` and writes one table over
the runs (:mod:`experiments.results.profile_table`) and its plots
(:mod:`experiments.results.profile_plots`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from experiments.harness.load_levels import ARRIVALS, LoadLevel
from experiments.harness.saturation import SaturationRule

#: runs one level into a folder and returns its summary (``status``, ``metrics``, ``saturated``...)
ExecuteLevel = Callable[[LoadLevel, Path, SaturationRule], dict[str, Any]]
SLO_FIELDS = ("ttft_s", "tpot_s", "e2e_s")


@dataclass
class LevelRun:
    """One run of a series: its level, where its files are, its summary and (max_goodput) its verdict."""

    level: LoadLevel
    folder: Path
    summary: dict[str, Any]
    verdict: str | None = None

    @property
    def failed(self) -> bool:
        return self.summary.get("status") != "ok"

    def metric(self, name: str) -> float | None:
        value = self.summary.get("metrics", {}).get(name)
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)

    @property
    def slo_share(self) -> float | None:
        """Share of the run's requests that met every SLO."""
        total, good = self.metric("num_requests"), self.metric("num_good_requests")
        return good / total if total and good is not None else None


@dataclass
class Series:
    """The runs of one profile, each in ``out_dir/<nn>-<level>/``, and what happened to the series:
    ``stopped`` says why it ended before its planned levels (``skipped``), ``failed`` that an
    anchor run failed (the profile has no result)."""

    out_dir: Path
    execute: ExecuteLevel
    saturation: SaturationRule
    runs: list[LevelRun] = field(default_factory=list)
    skipped: list[LoadLevel] = field(default_factory=list)
    stopped: str | None = None
    failed: bool = False
    result: dict[str, Any] = field(default_factory=dict)

    def run(self, level: LoadLevel) -> LevelRun:
        folder = self.out_dir / f"{len(self.runs):02d}-{level.label}"
        run = LevelRun(level, folder, self.execute(level, folder, self.saturation))
        self.runs.append(run)
        return run

    def stop(self, reason: str, skipped: list[LoadLevel] = ()) -> None:
        self.stopped = reason
        self.skipped.extend(skipped)


class Profile(Protocol):
    """A rule for the levels of a series (see the module docstring)."""

    name: str
    saturation: SaturationRule

    def run_series(self, series: Series) -> None: ...


SYNCHRONOUS = LoadLevel("synchronous", rate=math.inf, concurrency=1)
THROUGHPUT = LoadLevel("throughput", rate=math.inf, concurrency=None)


def anchors(series: Series) -> tuple[LevelRun, LevelRun] | None:
    """The synchronous and the throughput run; ``None`` (series stopped and failed) when either fails."""
    synchronous = series.run(SYNCHRONOUS)
    if synchronous.failed or not synchronous.metric("request_throughput"):
        series.failed = True
        series.stop(f"the synchronous run failed: {synchronous.summary.get('error')}", [THROUGHPUT])
        return None
    throughput = series.run(THROUGHPUT)
    if throughput.failed or not throughput.metric("request_throughput"):
        series.failed = True
        series.stop(f"the saturating (throughput) run failed: {throughput.summary.get('error')}")
        return None
    return synchronous, throughput


def run_ascending(series: Series, levels: list[LoadLevel], early_stop: bool) -> None:
    """Run ``levels`` in order; with ``early_stop``, stop after the first saturated run."""
    for index, level in enumerate(levels):
        run = series.run(level)
        reason = run.summary.get("saturated")
        if early_stop and reason:
            if index + 1 < len(levels):
                series.stop(f"saturated at {level.label}: {reason}", levels[index + 1:])
            else:
                series.stop(f"saturated at {level.label} (the last level): {reason}")
            return


def between(low: float, high: float, count: int) -> list[float]:
    """``count`` values evenly spaced strictly between ``low`` and ``high``, ascending."""
    return np.linspace(low, high, count + 2)[1:-1].tolist()


def _check_arrival(arrival: str) -> None:
    if arrival not in ARRIVALS:
        raise ValueError(f"profile.arrival must be one of {ARRIVALS}, got {arrival!r}")


@dataclass
class FixedProfile:
    """One run as configured, in the output folder itself: the workload's own arrivals and cap
    (run.py's plain run; no series, no table)."""

    name: str = "fixed"


@dataclass
class RateSweep:
    """Synchronous, throughput, then ``num_rates`` rates between the two measured request rates."""

    num_rates: int = 5
    arrival: str = "poisson"
    early_stop: bool = True
    saturation: SaturationRule = field(default_factory=SaturationRule)
    name: str = "rate_sweep"

    def __post_init__(self) -> None:
        if self.num_rates < 1:
            raise ValueError(f"profile.num_rates must be >= 1, got {self.num_rates}")
        _check_arrival(self.arrival)

    def run_series(self, series: Series) -> None:
        found = anchors(series)
        if found is None:
            return
        low, high = (run.metric("request_throughput") for run in found)
        series.result.update(synchronous_rate=low, throughput_rate=high)
        if high <= low:
            series.stop(f"the throughput run's request rate ({high:.4g}/s) is not above the synchronous run's "
                        f"({low:.4g}/s): nothing lies between them")
            return
        levels = [LoadLevel("rate", rate=r, arrival=self.arrival) for r in between(low, high, self.num_rates)]
        run_ascending(series, levels, self.early_stop)


def littles_law_concurrency(run: LevelRun) -> float:
    """Requests in flight on average: request rate x mean E2E (Little's law)."""
    return run.metric("request_throughput") * run.metric("e2e_s_mean")


def concurrency_levels(low: float, high: float, count: int) -> list[int]:
    """``count`` caps evenly spaced strictly between the anchors' concurrencies ``low`` and ``high``,
    rounded to whole requests; duplicates, and caps outside ``(max(low, 1), high)``, dropped (a
    cap of 1 is the synchronous run itself)."""
    return sorted({c for c in (round(v) for v in between(low, high, count)) if max(low, 1.0) < c < high})


@dataclass
class ConcurrencySweep:
    """Synchronous, throughput, then ``num_levels`` caps between the anchors' Little's-law concurrencies."""

    num_levels: int = 5
    early_stop: bool = True
    saturation: SaturationRule = field(default_factory=SaturationRule)
    name: str = "concurrency_sweep"

    def __post_init__(self) -> None:
        if self.num_levels < 1:
            raise ValueError(f"profile.num_levels must be >= 1, got {self.num_levels}")

    def run_series(self, series: Series) -> None:
        found = anchors(series)
        if found is None:
            return
        low, high = (littles_law_concurrency(run) for run in found)
        caps = concurrency_levels(low, high, self.num_levels)
        series.result.update(synchronous_concurrency=low, throughput_concurrency=high, levels=caps)
        if not caps:
            series.stop(f"the anchors' concurrencies ({low:.3g} and {high:.3g}) leave no whole cap between them")
            return
        run_ascending(series, [LoadLevel("concurrency", rate=math.inf, concurrency=c) for c in caps], self.early_stop)


@dataclass
class MaxGoodput:
    """Bisection for the highest rate at which ``min_share`` of requests meet every SLO in ``slo``."""

    slo: Mapping[str, float | None] | None = None
    min_share: float = 0.9
    tolerance: float = 0.05
    max_probes: int = 8
    arrival: str = "poisson"
    saturation: SaturationRule = field(default_factory=SaturationRule)
    name: str = "max_goodput"

    def __post_init__(self) -> None:
        if self.slo is None or all(self.slo.get(name) is None for name in SLO_FIELDS):
            raise ValueError("profile=max_goodput needs an SLO: set at least one of "
                             + ", ".join(f"slo.{name}" for name in SLO_FIELDS))
        if not 0 < self.min_share <= 1:
            raise ValueError(f"profile.min_share must be in (0, 1], got {self.min_share}")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"profile.tolerance must be in (0, 1), got {self.tolerance}")
        if self.max_probes < 1:
            raise ValueError(f"profile.max_probes must be >= 1, got {self.max_probes}")
        _check_arrival(self.arrival)

    def judge(self, run: LevelRun) -> bool:
        """Record the run's verdict (``meets`` / ``misses`` / ``failed``); True when it meets."""
        share = run.slo_share
        run.verdict = "failed" if run.failed else "meets" if share is not None and share >= self.min_share else "misses"
        return run.verdict == "meets"

    def run_series(self, series: Series) -> None:
        found = anchors(series)
        if found is None:
            return
        synchronous, throughput = found
        series.result.update(min_share=self.min_share, slo={n: self.slo.get(n) for n in SLO_FIELDS},
                             synchronous_slo_share=synchronous.slo_share,
                             throughput_rate=throughput.metric("request_throughput"))
        if not self.judge(synchronous):
            series.result.update(max_goodput_rate=None)
            series.stop(f"even one request at a time, only {synchronous.slo_share:.1%} of requests meet the SLOs "
                        f"(< {self.min_share:.0%})")
            return
        self.bisect(series, 0.0, throughput.metric("request_throughput"))

    def bisect(self, series: Series, low: float, high: float) -> None:
        """``low``: highest rate known to meet (0 = none measured); ``high``: the bracket's top,
        probed first (the throughput run's rate)."""
        best: LevelRun | None = None
        probe_rate, probes = high, 0
        while probes < self.max_probes:
            run = series.run(LoadLevel("probe", rate=probe_rate, arrival=self.arrival))
            probes += 1
            if self.judge(run):
                low, best = probe_rate, run
                if probe_rate == high:  # the bracket's top itself meets the SLOs: nothing higher to find
                    break
            else:
                high = probe_rate
            if high - low <= self.tolerance * high:
                break
            probe_rate = (low + high) / 2
        converged = best is not None and (low == high or high - low <= self.tolerance * high)
        series.result.update(max_goodput_rate=low if best is not None else None, bracket=[low, high], probes=probes,
                             converged=converged, best_run=best.folder.name if best is not None else None,
                             best_request_throughput=best.metric("request_throughput") if best else None,
                             best_goodput=best.metric("goodput") if best else None)
        if best is None:
            series.stop(f"no probed rate met the SLOs for {self.min_share:.0%} of requests "
                        f"(lowest probe {high:.4g} req/s)")
        elif not converged:
            series.stop(f"max_probes ({self.max_probes}) reached before the bracket "
                        f"[{low:.4g}, {high:.4g}] req/s narrowed to {self.tolerance:.0%} of its top")
