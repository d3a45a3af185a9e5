"""A load level: how hard one run of a load profile pushes the server.

A profile (:mod:`experiments.harness.profiles`) runs the same workload several times, each at one
:class:`LoadLevel`, which overrides how the workload's requests are sent:

* ``rate`` (req/s): the arrival offsets are rewritten to that rate, ``constant`` (evenly spaced,
  guidellm's constant profile) or ``poisson`` (exponential gaps, guidellm's / vLLM's Poisson);
  ``inf`` sends everything at t=0. ``None`` keeps the workload's own arrivals.
* ``concurrency``: the client-side cap on requests in flight (``None`` = no cap).

The synchronous run is ``rate=inf, concurrency=1`` (one request at a time, back to back); the
saturating run is ``rate=inf, concurrency=None`` (everything at once: the server's throughput).
The prompts, lengths and order stay those of the workload, so levels differ only in load.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from experiments.harness.workloads import WorkloadRequest, gamma_arrival_offsets

ARRIVALS = ("constant", "poisson")


@dataclass(frozen=True)
class LoadLevel:
    """One run's load: ``phase`` names its role in the profile (synchronous, throughput, rate, ...)."""

    phase: str
    rate: float | None = None
    concurrency: int | None = None
    arrival: str = "poisson"

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"a load level's rate must be > 0 (or inf), got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"a load level's concurrency must be >= 1 or null, got {self.concurrency}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")

    @property
    def label(self) -> str:
        """A folder-safe name: ``synchronous``, ``throughput``, ``rate-2.5``, ``concurrency-8``, ``probe-1.25``
        (the phase, then the level's rate when it has a finite one, else its cap)."""
        if self.phase in ("synchronous", "throughput"):
            return self.phase
        if self.rate is not None and not math.isinf(self.rate):
            return f"{self.phase}-{self.rate:.4g}"
        return f"{self.phase}-{self.concurrency}"

    def apply(self, requests: Sequence[Any], seed: int) -> list[WorkloadRequest]:
        """The workload's requests with this level's arrival times (``ValueError`` for workloads
        that are not a list of independent requests, such as multi-turn sessions)."""
        if not isinstance(requests, list) or not all(isinstance(r, WorkloadRequest) for r in requests):
            raise ValueError(f"load profiles re-time a list of independent requests; this workload is a "
                             f"{type(requests).__name__} (use profile=fixed)")
        if self.rate is None:
            return requests
        if self.arrival == "constant" and not math.isinf(self.rate):
            offsets = [i / self.rate for i in range(len(requests))]
        else:
            offsets = gamma_arrival_offsets(len(requests), self.rate, 1.0, np.random.default_rng([seed, 4]))
        return [replace(r, arrival_offset_s=offset) for r, offset in zip(requests, offsets)]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rate": None if self.rate is None or math.isinf(self.rate) else self.rate,
                "all_at_once": self.rate is not None and math.isinf(self.rate)}
