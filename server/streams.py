"""Engine outputs turned into OpenAI response bodies: whole responses and streaming chunks.

The engine reports each request cumulatively (all tokens so far, the text so far); a stream
sends only what is new since its last chunk (:class:`Delta`). One chunk per engine step that
gave the request a token, so the client sees one chunk per token (what ``vllm bench serve``
times as inter-token latency). The last token's chunk carries ``finish_reason``; with
``stream_options.include_usage`` a final chunk with ``choices: []`` carries the usage, whose
``prompt_tokens_details.cached_tokens`` is the prompt tokens served by the prefix cache.

Chat streams open with the assistant role in the first chunk, together with the first token
(no empty role-only chunk, so the first chunk with choices is the first token: TTFT is honest).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from server.engine_thread import EngineDead, GenerationStream, Rejected


class StreamFailed(Exception):
    """The request ended without an answer: rejected by the engine, its step failed, or the engine died."""

    def __init__(self, message: str, status: int, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


async def engine_outputs(stream: GenerationStream) -> AsyncIterator[Any]:
    """The request's outputs until the finished one; raises :class:`StreamFailed` on errors."""
    while True:
        item = await stream.outputs.get()
        if isinstance(item, Rejected):
            raise StreamFailed(item.message, 400, "invalid_value")
        if isinstance(item, EngineDead):
            raise StreamFailed(item.message, 503, "engine_unavailable")
        if item.finish_reason == "error":
            raise StreamFailed(f"the engine step running this request failed: {item.error}", 500, "engine_error")
        yield item
        if item.finished:
            return


@dataclass(frozen=True)
class ResponseShape:
    """What every body of one response shares."""

    kind: Literal["completion", "chat"]
    model: str
    return_token_ids: bool
    response_id: str = ""
    created: int = 0

    @classmethod
    def new(cls, kind: Literal["completion", "chat"], model: str, return_token_ids: bool) -> "ResponseShape":
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        return cls(kind, model, return_token_ids, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}


class Delta:
    """What a stream has sent so far; :meth:`take` returns what is new in an output."""

    def __init__(self) -> None:
        self.tokens = 0
        self.text = ""

    def take(self, output: Any) -> tuple[list[int], str]:
        token_ids = output.token_ids[self.tokens:]
        full_text = getattr(output, "text", "") or ""
        text = full_text[len(self.text):]
        self.tokens = len(output.token_ids)
        self.text = full_text
        return token_ids, text


def usage(output: Any) -> dict[str, Any]:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(output.num_cached_tokens)}}


def _choice(shape: ResponseShape, text: str, token_ids: list[int], finish_reason: str | None, chunk: bool,
            first: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if shape.kind == "completion":
        choice.update(text=text, logprobs=None)
    elif chunk:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        choice["logprobs"] = None
    else:
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    if shape.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return choice


def stream_chunk(shape: ResponseShape, output: Any, delta: Delta) -> dict[str, Any]:
    """The chunk for one step's output: its new tokens / text, and the finish reason if it ended."""
    first = delta.tokens == 0
    token_ids, text = delta.take(output)
    reason = output.finish_reason if output.finished else None
    return shape.envelope([_choice(shape, text, token_ids, reason, chunk=True, first=first)], chunk=True)


def usage_chunk(shape: ResponseShape, output: Any) -> dict[str, Any]:
    return {**shape.envelope([], chunk=True), "usage": usage(output)}


def full_response(shape: ResponseShape, output: Any) -> dict[str, Any]:
    """The non-streaming body for a finished request."""
    choice = _choice(shape, getattr(output, "text", "") or "", output.token_ids, output.finish_reason,
                     chunk=False, first=True)
    body = {**shape.envelope([choice], chunk=False), "usage": usage(output)}
    if shape.return_token_ids:
        body["prompt_token_ids"] = list(output.prompt_token_ids)
    return body
