"""The one thread that owns the engine: it takes commands from a queue and loops ``step()``.

Why a thread: a forward pass takes tens of milliseconds of CPU/GPU work (PyTorch releases the
GIL inside its kernels); run on the event loop it would stall every other connection. Why one:
the engine (scheduler, cache, sampler) is not thread-safe, so exactly one thread mutates it.

Handlers never call the engine. They create a :class:`GenerationStream` and :meth:`submit` it
(an ``add`` command) or :meth:`abort` it (an ``abort`` command); both go through one FIFO
``queue.Queue``, so an abort can never overtake the add it cancels. The engine thread drains the
queue between steps (blocking on it while idle), applies the commands, steps, and hands each
request's new :class:`~engine.outputs.RequestOutput` to the request's own ``asyncio.Queue`` with
``loop.call_soon_threadsafe`` (asyncio queues are not thread-safe; this schedules the put on the
loop's own thread).

Backpressure: a request is *waiting* from its submit until its first token (or its end). When
``max_waiting`` requests are waiting, :meth:`submit` raises :class:`ServerBusy` and queues
nothing (the route answers 503 with ``Retry-After``).

If the loop itself dies (a bug, not a failing forward pass, which the engine already confines to
that step's requests), every live stream gets an :class:`EngineDead` item and ``alive`` turns
False (``/health`` answers 503).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Union

from engine.device import activate
from engine.sampling_params import SamplingParams
from server.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineDead:
    """Delivered to a stream whose request can never finish (the engine thread died or stopped)."""

    message: str


@dataclass(frozen=True)
class Rejected:
    """Delivered when the engine refused the request at ``add_request`` (its ValueError text)."""

    message: str


@dataclass
class GenerationStream:
    """One request in flight: what was asked, and the queue its outputs arrive on.

    ``outputs`` receives cumulative ``RequestOutput`` objects (one per step that gave the request
    a token, the last with ``finished=True``), or one :class:`Rejected` / :class:`EngineDead`.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    number: int = 0          # server-side sequence number (set by submit)
    engine_id: int | None = None   # the engine's request id (set by the engine thread)
    counted_waiting: bool = False  # still counted in EngineThread.waiting (no token yet)


@dataclass
class _Live:
    stream: GenerationStream
    tokens_seen: int = 0


_Command = Union[tuple[str, GenerationStream], tuple[str, None]]


class ServerBusy(Exception):
    """Too many requests are waiting (or the server is shutting down); nothing was queued."""


class EngineThread:
    """Owns ``llm``; see the module docstring. ``start()``, then ``submit`` / ``abort`` from any thread."""

    def __init__(self, llm: Any, metrics: ServerMetrics, max_waiting: int, idle_poll_s: float = 0.5) -> None:
        if max_waiting < 1:
            raise ValueError(f"server.max_waiting must be >= 1, got {max_waiting}")
        self.llm = llm
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.idle_poll_s = idle_poll_s
        self.commands: queue.Queue[_Command] = queue.Queue()
        self.numbers = itertools.count()
        self.lock = threading.Lock()
        self.waiting = 0            # submitted, no token yet (guarded by lock)
        self.accepting = True
        self.failure: str | None = None
        self.thread = threading.Thread(target=self.run, name="servelab-engine", daemon=True)
        self.live: dict[int, _Live] = {}      # engine id -> stream (engine thread only)

    # -- any thread ------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.failure is None

    def start(self) -> None:
        self.thread.start()

    def submit(self, stream: GenerationStream) -> None:
        """Queue a request for the engine, or raise :class:`ServerBusy` (nothing queued)."""
        with self.lock:
            if not self.accepting or not self.alive:
                raise ServerBusy("the server is shutting down" if not self.accepting else
                                 f"the engine is not running: {self.failure}")
            if self.waiting >= self.max_waiting:
                raise ServerBusy(f"{self.waiting} requests are already waiting for the engine "
                                 f"(server.max_waiting={self.max_waiting}); retry later")
            self.waiting += 1
            stream.counted_waiting = True
            stream.number = next(self.numbers)
        self.commands.put(("add", stream))

    def abort(self, stream: GenerationStream) -> None:
        """Ask the engine to drop the request (no-op if it already finished)."""
        self.commands.put(("abort", stream))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, abort everything in flight, let the thread deliver the aborts and exit."""
        self.begin_shutdown()
        self.commands.put(("stop", None))
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort every request in flight (their streams end with "abort")."""
        with self.lock:
            self.accepting = False
        self.commands.put(("abort_all", None))

    # -- the engine thread -----------------------------------------------------------------
    def run(self) -> None:
        try:
            activate(self.llm.device)  # a new thread starts on CUDA device 0
            stopping = False
            while not (stopping and not self.llm.has_unfinished()):
                idle = not self.llm.has_unfinished()
                for kind, stream in self.next_commands(block=idle and not stopping):
                    stopping |= kind == "stop"
                    self.apply(kind, stream)
                if self.llm.has_unfinished():
                    self.dispatch(self.llm.step())
                    self.observe_engine()
        except Exception as error:  # noqa: BLE001 -- a bug in the loop: fail every stream, report unhealthy
            self.failure = f"{type(error).__name__}: {error}"
            log.error("engine thread died: %s\n%s", self.failure, traceback.format_exc())
        finally:
            self.fail_all(self.failure or "the server stopped")

    def next_commands(self, block: bool) -> list[_Command]:
        commands = []
        if block:
            try:
                commands.append(self.commands.get(timeout=self.idle_poll_s))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands

    def apply(self, kind: str, stream: GenerationStream | None) -> None:
        if kind == "add":
            self.add(stream)
        elif kind == "abort":
            if stream.engine_id is not None and stream.engine_id in self.live:
                self.llm.abort_request(stream.engine_id)
        elif kind == "abort_all":
            for engine_id in list(self.live):
                self.llm.abort_request(engine_id)

    def add(self, stream: GenerationStream) -> None:
        if not self.accepting:  # submitted just before shutdown began: never started
            self.release_waiting(stream)
            self.deliver(stream, EngineDead("the server is shutting down"))
            return
        try:
            stream.engine_id = self.llm.add_request(stream.prompt_token_ids, stream.params,
                                                    arrival_time=stream.arrival_time)
        except ValueError as error:
            self.release_waiting(stream)
            self.deliver(stream, Rejected(str(error)))
            return
        self.live[stream.engine_id] = _Live(stream)

    def dispatch(self, outputs: list[Any]) -> None:
        for output in outputs:
            live = self.live.get(output.request_id)
            if live is None:
                continue
            self.metrics.observe_output(output, live.tokens_seen)
            live.tokens_seen = len(output.token_ids)
            if output.token_ids or output.finished:
                self.release_waiting(live.stream)
            if output.finished:
                del self.live[output.request_id]
            self.deliver(live.stream, output)

    def observe_engine(self) -> None:
        records = self.llm.step_records
        self.metrics.observe_engine(self.llm.scheduler, self.llm.cache.stats(), records)
        # The server runs for days: the metrics consumed the per-step log; keep it from growing.
        records.clear()

    def release_waiting(self, stream: GenerationStream) -> None:
        if stream.counted_waiting:
            stream.counted_waiting = False
            with self.lock:
                self.waiting -= 1

    def fail_all(self, message: str) -> None:
        """End every stream the engine will never finish: live ones and adds still queued."""
        with self.lock:
            self.accepting = False
        streams = [live.stream for live in self.live.values()]
        self.live.clear()
        streams += [stream for kind, stream in self.next_commands(block=False) if kind == "add"]
        for stream in streams:
            self.release_waiting(stream)
            self.deliver(stream, EngineDead(message))

    @staticmethod
    def deliver(stream: GenerationStream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
