"""Workloads whose later requests depend on earlier results: the follow-up protocol.

Most workloads are a fixed list of requests, known before the run starts. A multi-turn chat is
not: turn k's prompt holds the engine's answer to turn k-1, and turn k is sent only after that
answer came back (plus the user's think time). Such a workload implements :class:`FollowUps`:

* :meth:`FollowUps.first_requests` gives what is known up front (every user's first turn);
* the driver calls :meth:`FollowUps.after` once for every request that finished successfully,
  with the :class:`Answer` it got back, and submits the requests it returns at their
  ``arrival_offset_s`` (seconds after the run's start, like every workload request);
* the run ends when nothing is in flight and nothing more is pending: a workload bounds its own
  total by returning no more follow-ups (``total_requests`` is that bound, for progress bars);
* :meth:`FollowUps.tables` turns the finished run's records into the workload's own result tables
  (written as ``<name>.csv`` and kept in ``summary.json``).

Both drivers speak it: the in-process one (:func:`experiments.harness.driver.drive`) and the HTTP
load client (:func:`experiments.http.client.run_load`), so a dependent workload runs the same way on
every engine.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from experiments.harness.records import RequestRecord
from experiments.harness.workloads import WorkloadRequest


@dataclass(frozen=True)
class Answer:
    """What came back for one finished request.

    Attributes:
        token_ids: the generated token ids (empty when an HTTP server does not return them).
        text: the generated text ("" from an engine without a tokenizer).
        finish_s: when the client had the complete answer, seconds after the run's start.
    """

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_s: float = 0.0


@runtime_checkable
class FollowUps(Protocol):
    """A workload that issues requests as earlier ones finish (see the module docstring)."""

    total_requests: int

    def first_requests(self) -> list[WorkloadRequest]: ...

    def after(self, request: WorkloadRequest, answer: Answer) -> list[WorkloadRequest]: ...

    def issued(self) -> list[WorkloadRequest]: ...

    def tables(self, records: Sequence[RequestRecord]) -> dict[str, list[dict[str, Any]]]: ...
