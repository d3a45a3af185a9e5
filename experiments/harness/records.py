"""Engine-agnostic per-request records: what every engine (servelab or a peer) reports.

All times are seconds relative to the run start (the driver's ``t0`` on the engine clock), so
``requests.csv`` is readable and runs are comparable. Conversion from an engine's
``RequestOutput`` (or a peer's look-alike) happens once, here.

Two client-side times, as in vLLM's serving benchmark: ``arrival_s`` is when the workload wanted
to send the request, ``submit_s`` when the client actually *sent* it (later when a client-side
concurrency cap held it back). Latency clocks (TTFT, E2E) start at ``submit_s``; the wait behind
the cap is ``client_queue_s = submit_s - arrival_s`` (vLLM's ``client_queue_time``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import decode


@dataclass
class RequestRecord:
    """One finished request, as measured by the driver and the engine.

    Attributes:
        request_id: the workload's name for the request (``req-0003``).
        engine_request_id: the id the engine returned from ``add_request``.
        prompt_tokens: prompt length.
        output_tokens: generated tokens.
        arrival_s: when the workload wanted to send the request (its arrival offset).
        submit_s: when the client sent it (handed it to the engine or posted it to the server):
            the start of TTFT and E2E; later than ``arrival_s`` when the client-side
            concurrency cap made it wait.
        first_scheduled_s: when the engine first computed any of its tokens (None if unknown).
        first_token_s: when its first generated token was available.
        finish_s: when its last token was available.
        token_times_s: the time of every generated token (len == output_tokens).
        num_cached_tokens: prompt tokens served by a prefix-cache hit.
        num_preemptions: times the request was preempted (and recomputed).
        finish_reason: ``length``, ``stop``, ``abort`` or ``error``.
        output_token_ids: the generated token ids.
        prompt_text: what the user wrote (a chat request's message) or, for token-id prompts,
            their decoded text ("" without a tokenizer).
        output_text: the generated text ("" without a tokenizer).
        priority: its ``SamplingParams.priority`` (its class: the workload's ``interactive_fraction``
            gives interactive requests one priority and batch requests another).
    """

    request_id: str
    engine_request_id: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    submit_s: float
    first_scheduled_s: float | None
    first_token_s: float
    finish_s: float
    token_times_s: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    priority: int = 0
    prompt_text: str = ""
    output_text: str = ""

    @property
    def client_queue_s(self) -> float:
        """Wait behind the client-side concurrency cap: send - arrival (vLLM's ``client_queue_time``)."""
        return self.submit_s - self.arrival_s


def _relative(value: float | None, t0: float) -> float | None:
    return None if value is None else float(value) - t0


def record_from_output(
    output: Any, request_id: str, submit_time: float, t0: float, arrival_time: float | None = None
) -> RequestRecord:
    """Build a record from a finished ``RequestOutput`` (see docs/CONTRACTS.md) or a peer's look-alike.

    ``submit_time`` is the send time (engine clock); ``arrival_time`` the time the workload wanted
    to send it (default: the engine's ``output.arrival_time``, i.e. no client-side wait)."""
    token_times = [float(t) - t0 for t in (output.token_times or [])]
    first_token = _relative(output.first_token_time, t0)
    finish = _relative(output.finish_time, t0)
    return RequestRecord(
        request_id=request_id,
        engine_request_id=str(output.request_id),
        prompt_tokens=len(output.prompt_token_ids),
        output_tokens=len(output.token_ids),
        arrival_s=float(output.arrival_time if arrival_time is None else arrival_time) - t0,
        submit_s=submit_time - t0,
        first_scheduled_s=_relative(getattr(output, "first_scheduled_time", None), t0),
        first_token_s=first_token if first_token is not None else finish,
        finish_s=finish,
        token_times_s=token_times,
        num_cached_tokens=int(getattr(output, "num_cached_tokens", 0) or 0),
        num_preemptions=int(getattr(output, "num_preemptions", 0) or 0),
        finish_reason=getattr(output, "finish_reason", None),
        output_token_ids=list(output.token_ids),
        output_text=getattr(output, "text", "") or "",
    )


def fill_priorities(records: list[RequestRecord], requests: Sequence[Any]) -> None:
    """Set each record's ``priority`` from its workload request (matched by ``request_id``)."""
    by_name = {request.request_id: request for request in requests}
    for record in records:
        record.priority = by_name[record.request_id].sampling_params.priority


def fill_texts(records: list[RequestRecord], requests: Sequence[Any], tokenizer: Any | None) -> None:
    """Set each record's ``prompt_text`` from its workload request (the chat message, else the
    decoded prompt ids) and, for engines that report no text (the HF peers), its ``output_text``
    from the output ids. Records and requests are matched by ``request_id``."""
    by_name = {request.request_id: request for request in requests}
    for record in records:
        request = by_name[record.request_id]
        record.prompt_text = request.prompt_text or decode(tokenizer, request.prompt_token_ids)
        if not record.output_text:
            record.output_text = decode(tokenizer, record.output_token_ids)


def step_to_dict(step: Any) -> dict[str, Any]:
    """A ``StepRecord`` (dataclass or plain object) as a flat dict."""
    if isinstance(step, dict):
        return dict(step)
    if hasattr(step, "__dataclass_fields__"):
        return {name: getattr(step, name) for name in step.__dataclass_fields__}
    return dict(vars(step))
