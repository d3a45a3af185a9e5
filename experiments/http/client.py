"""Drive a workload through any OpenAI-compatible server over HTTP, the way ``vllm bench serve`` does.

The in-process driver (:mod:`experiments.harness.driver`) steps an engine it owns; this one only talks
HTTP, so it measures any server: servelab's own (``serve.py``), vLLM, SGLang, llama.cpp's
``llama-server``. It follows vLLM's benchmark client (``vllm/benchmarks/lib/endpoint_request_func.py``
and ``vllm/benchmarks/serve.py``):

* every request streams (``stream: true``, ``stream_options.include_usage: true``) over one
  aiohttp session whose connector allows as many connections as the concurrency cap;
* a request waits for its arrival offset, then for the client-side concurrency cap (an
  ``asyncio.Semaphore``); the clock starts when it is *sent* (``submit_s``); the wait behind the
  cap is the client queue time;
* TTFT is the first chunk with non-empty ``choices`` (a usage-only chunk is not a token); every
  later such chunk adds one inter-token latency; the request ends at its last token chunk;
* the output length is the usage chunk's ``completion_tokens`` (the chunk count if a server
  sends no usage);
* a request fails on a non-200 status, an exception (timeout, connection), an error object inside
  the stream, or a stream without any token chunk; failures are counted with their reason and
  left out of every latency statistic.

A workload whose later requests depend on earlier answers (multi-turn sessions) passes
``follow_ups`` (:class:`~experiments.harness.follow_ups.FollowUps`): when a request's stream ends
successfully, its answer (text, and token ids when the server returns them) goes to it, and the
requests it returns are sent at their arrival offsets, as the in-process driver does.

Prompts are token ids or, for a text workload (``workload.prompt_format=text``), text (completions
endpoint), or, for the chat endpoint, messages: a chat workload's conversation, or a prompt's text
(a token-id prompt decoded with the model's tokenizer) as one user message.
"""
from __future__ import annotations

import asyncio
import json
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from tqdm import tqdm

from experiments.harness.driver import DriveResult
from experiments.harness.follow_ups import Answer, FollowUps
from experiments.harness.records import RequestRecord
from experiments.harness.workloads import WorkloadRequest

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True)
class HTTPTarget:
    """Where and how to send requests.

    Attributes:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the ``model`` field of every request.
        endpoint: ``completions`` (token-id prompts) or ``chat`` (text prompts, one user message).
        api_key: sent as ``Authorization: Bearer <key>`` when set.
        timeout_s: total time one request may take.
        extra_body: extra JSON fields merged into every request (e.g. ``{"return_token_ids": true}``).
    """

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    api_key: str | None = None
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.base_url.rstrip('/')}/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class HTTPOutcome:
    """One request as the client saw it (``perf_counter`` seconds; vLLM's ``RequestFuncOutput``)."""

    request: WorkloadRequest
    arrival: float = 0.0         # when it was due (t0 + arrival offset)
    start: float = 0.0           # when it was sent (after the concurrency cap)
    chunk_times: list[float] = field(default_factory=list)   # one per chunk with choices
    output_tokens: int | None = None   # from the usage chunk
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)       # when the server returns them
    text: str = ""
    finish_reason: str | None = None
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else 0.0

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.start if self.chunk_times else 0.0

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)


def request_payload(target: HTTPTarget, request: WorkloadRequest,
                    messages: list[dict[str, str]] | None = None) -> dict[str, Any]:
    params = request.sampling_params
    payload: dict[str, Any] = {"model": target.model, "temperature": params.temperature, "top_p": params.top_p,
                               "stream": True, "stream_options": {"include_usage": True}}
    if target.endpoint == "chat":
        payload["messages"] = messages
        payload["max_completion_tokens"] = params.max_tokens
    else:
        payload["prompt"] = request.text or list(request.prompt_token_ids)   # a text prompt goes as text
        payload["max_tokens"] = params.max_tokens
    if params.ignore_eos:
        payload["ignore_eos"] = True     # vLLM's extension (as `vllm bench serve` sends it)
    if params.top_k > 0:
        payload["top_k"] = params.top_k
    if params.seed is not None:
        payload["seed"] = params.seed
    payload.update(target.extra_body)
    return payload


def _take_chunk(outcome: HTTPOutcome, data: dict[str, Any], now: float) -> None:
    if data.get("error"):
        error = data["error"]
        outcome.error = f"error in stream: {error.get('message', error) if isinstance(error, dict) else error}"
        return
    if choices := data.get("choices"):
        choice = choices[0]
        outcome.chunk_times.append(now)
        outcome.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        outcome.token_ids += choice.get("token_ids") or []
        outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    elif usage := data.get("usage"):
        outcome.output_tokens = usage.get("completion_tokens")
        outcome.prompt_tokens = usage.get("prompt_tokens")
        outcome.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def send(session: aiohttp.ClientSession, target: HTTPTarget, payload: dict[str, Any],
               outcome: HTTPOutcome) -> HTTPOutcome:
    """Send one streaming request and fill ``outcome`` (never raises: failures land in ``outcome.error``)."""
    outcome.start = time.perf_counter()
    try:
        async with session.post(target.url, json=payload, headers=target.headers) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return outcome
            async for raw in response.content:
                line = raw.decode("utf-8").strip()
                if not line or line.startswith(":"):
                    continue
                message = line.removeprefix("data:").strip()
                if message == "[DONE]":
                    break
                _take_chunk(outcome, json.loads(message), time.perf_counter())
                if outcome.error:
                    break
        if not outcome.error and not outcome.chunk_times:
            outcome.error = "no chunk with choices: the response carried no token"
    except Exception as error:  # noqa: BLE001 -- counted as a failed request, as vLLM's client does
        outcome.error = f"{type(error).__name__}: {error}" or traceback.format_exc(limit=1)
    return outcome


@dataclass
class LoadRun:
    """Every request's outcome, in workload order, and the run's clock."""

    outcomes: list[HTTPOutcome]
    t0: float
    wall_s: float


async def run_load(target: HTTPTarget, requests: Sequence[WorkloadRequest], max_concurrency: int | None,
                   chat_messages: dict[str, list[dict[str, str]]] | None = None, progress: bool = True,
                   follow_ups: FollowUps | None = None) -> LoadRun:
    """Send ``requests`` (and the ``follow_ups`` they lead to) at their arrival offsets, at most
    ``max_concurrency`` in flight."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, limit_per_host=max_concurrency or 0,
                                     keepalive_timeout=60)
    cap = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=follow_ups.total_requests if follow_ups else len(requests), desc="requests", unit="req",
               disable=not progress)
    conversations = chat_messages or {}
    tasks: list[asyncio.Task[HTTPOutcome]] = []

    async def one(session: aiohttp.ClientSession, request: WorkloadRequest, t0: float) -> HTTPOutcome:
        outcome = HTTPOutcome(request, arrival=t0 + request.arrival_offset_s)
        await asyncio.sleep(max(0.0, outcome.arrival - time.perf_counter()))
        payload = request_payload(target, request, conversations.get(request.request_id) or list(request.messages))
        if cap is None:
            await send(session, target, payload, outcome)
        else:
            async with cap:
                await send(session, target, payload, outcome)
        bar.update(1)
        if follow_ups is not None and outcome.success:
            answer = Answer(list(outcome.token_ids), outcome.text, time.perf_counter() - t0)
            for later in follow_ups.after(request, answer):
                tasks.append(asyncio.ensure_future(one(session, later, t0)))
        return outcome

    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            t0 = time.perf_counter()
            tasks.extend(asyncio.ensure_future(one(session, r, t0)) for r in requests)
            for task in tasks:  # grows while it is walked: follow-ups join as their turn comes
                await task
            outcomes = [task.result() for task in tasks]
            wall = time.perf_counter() - t0
    finally:
        bar.close()
    return LoadRun(list(outcomes), t0, wall)


async def warm_up(target: HTTPTarget, requests: Sequence[WorkloadRequest],
                  chat_messages: dict[str, list[dict[str, str]]]) -> None:
    """Untimed requests first; like vLLM's initial test run, a failure stops the benchmark."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=target.timeout_s)) as session:
        for request in requests:
            outcome = await send(session, target, request_payload(target, request, chat_messages.get(request.request_id)),
                                 HTTPOutcome(request))
            if not outcome.success:
                raise RuntimeError(f"warm-up request to {target.url} failed: {outcome.error}")


def record_of(outcome: HTTPOutcome, t0: float) -> RequestRecord:
    """A successful outcome as the harness's per-request record (times relative to ``t0``)."""
    times = [t - t0 for t in outcome.chunk_times]
    return RequestRecord(
        request_id=outcome.request.request_id,
        engine_request_id="",
        prompt_tokens=outcome.prompt_tokens if outcome.prompt_tokens is not None
        else len(outcome.request.prompt_token_ids),
        output_tokens=outcome.num_output_tokens,
        arrival_s=outcome.arrival - t0,
        submit_s=outcome.start - t0,
        first_scheduled_s=None,
        first_token_s=times[0],
        finish_s=times[-1],
        token_times_s=times,
        num_cached_tokens=outcome.cached_tokens,
        finish_reason=outcome.finish_reason,
        output_token_ids=list(outcome.token_ids),
    )


def drive_result(run: LoadRun) -> DriveResult:
    """Successful requests as records; failures (with reasons) and their count beside them."""
    records = [record_of(o, run.t0) for o in run.outcomes if o.success]
    failures = [{"request_id": o.request.request_id, "error": o.error} for o in run.outcomes if not o.success]
    return DriveResult(records=records, steps=[], t0=run.t0, wall_s=run.wall_s,
                       extra_metrics={"num_failed_requests": len(failures)}, failures=failures)
