"""Is the server saturated? The signal that stops a load profile early.

Below saturation a server keeps up with arrivals: requests wait about as long at the end of a
run as at its start. Past it the queue grows for as long as requests keep arriving, and so does
every later request's wait. Two signs of that, over the run's arrival window:

* **TTFT trend**: the median TTFT of the last quarter of requests (by arrival) is at least
  ``ttft_growth`` times that of the first quarter, and above ``ttft_floor_s`` (so that
  micro-second noise at light load never counts);
* **growing queue**: the engine's waiting queue (``num_waiting`` of its steps; engines that report
  no steps skip this check), averaged over the second half of the arrival window, is at least
  ``queue_growth`` times its average over the first half and at least one request.

Either one marks the run saturated, with the reason in words; guidellm's over-saturation
constraint and vLLM's sweep stop on the same evidence.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from experiments.harness.metrics import ttft
from experiments.harness.records import RequestRecord


@dataclass(frozen=True)
class SaturationRule:
    """Thresholds of the two signs (see the module docstring)."""

    ttft_growth: float = 2.0
    ttft_floor_s: float = 0.05
    queue_growth: float = 2.0
    min_requests: int = 8

    def __post_init__(self) -> None:
        for name in ("ttft_growth", "queue_growth"):
            if not getattr(self, name) > 1:
                raise ValueError(f"profile.saturation.{name} must be > 1, got {getattr(self, name)}")
        if self.ttft_floor_s < 0:
            raise ValueError(f"profile.saturation.ttft_floor_s must be >= 0, got {self.ttft_floor_s}")
        if self.min_requests < 4:
            raise ValueError(f"profile.saturation.min_requests must be >= 4 (a quarter of them is compared), "
                             f"got {self.min_requests}")

    def check(self, records: Sequence[RequestRecord], steps: Sequence[dict[str, Any]]) -> str | None:
        """Why the run is saturated, or ``None`` when it is not (or is too short to tell)."""
        if len(records) < self.min_requests:
            return None
        ordered = sorted(records, key=lambda r: r.arrival_s)
        quarter = max(1, len(ordered) // 4)
        first = float(np.median([ttft(r) for r in ordered[:quarter]]))
        last = float(np.median([ttft(r) for r in ordered[-quarter:]]))
        if last >= self.ttft_floor_s and last >= self.ttft_growth * first:
            return f"TTFT grew from {first:.3g} s (first quarter, median) to {last:.3g} s (last quarter)"
        window = (ordered[0].arrival_s, ordered[-1].arrival_s)
        middle = (window[0] + window[1]) / 2
        early = [s["num_waiting"] for s in steps if s.get("num_waiting") is not None and window[0] <= s["start_time"] < middle]
        late = [s["num_waiting"] for s in steps if s.get("num_waiting") is not None and middle <= s["start_time"] <= window[1]]
        if early and late:
            before, after = float(np.mean(early)), float(np.mean(late))
            if after >= 1.0 and after >= self.queue_growth * max(before, 1e-9):
                return f"the waiting queue grew from {before:.3g} to {after:.3g} requests (mean, first vs second half of arrivals)"
        return None
