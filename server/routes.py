"""The endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``.

A generation request is checked (:mod:`server.requests`), submitted to the engine thread, and
answered either as one JSON body or as an SSE stream. Whichever way, a client that goes away
aborts its request: a streaming response is cancelled by Starlette when the client disconnects
(the generator's ``finally`` sends the abort); a non-streaming one races the engine's answer
against the ``http.disconnect`` message. The abort reaches the engine through the same command
queue as the add, and the request's KV blocks return at the next step boundary.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from server.engine_thread import EngineThread, GenerationStream, ServerBusy
from server.metrics import ServerMetrics
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from server.requests import ModelLimits, PreparedRequest, prepare_chat, prepare_completion
from server.sse import DONE, event
from server.streams import Delta, ResponseShape, StreamFailed, engine_outputs, full_response, stream_chunk, usage_chunk

RETRY_AFTER_S = "1"   # the Retry-After hint of a 503


@dataclass
class ServerState:
    """What the routes share, kept on ``app.state.servelab``."""

    engine: EngineThread
    limits: ModelLimits
    metrics: ServerMetrics
    api_key: str | None


def state_of(request: Request) -> ServerState:
    return request.app.state.servelab


async def require_api_key(request: Request) -> None:
    """With ``server.api_key`` set, ``/v1/*`` needs ``Authorization: Bearer <key>`` (else 401)."""
    key = state_of(request).api_key
    if key and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {key}"):
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <server.api_key>'",
                       code="invalid_api_key", error_type="authentication_error")


open_routes = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@open_routes.get("/health")
async def health(request: Request) -> Response:
    engine = state_of(request).engine
    if engine.alive:
        return JSONResponse({"status": "ok"})
    return JSONResponse(error_body(f"the engine thread is not running: {engine.failure or 'stopped'}",
                                   "server_error", None, "engine_unavailable"), status_code=503)


@open_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@v1.get("/models")
async def models(request: Request) -> dict[str, Any]:
    limits = state_of(request).limits
    name = limits.served_model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "servelab",
                                        "root": name, "parent": None, "max_model_len": limits.max_context}]}


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = state_of(request)
    prepared = prepare_completion(body, state.limits)
    shape = ResponseShape.new("completion", state.limits.served_model_name, body.return_token_ids)
    return await answer(request, state, prepared, shape, body.stream, body.include_usage)


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = state_of(request)
    prepared = prepare_chat(body, state.limits)
    shape = ResponseShape.new("chat", state.limits.served_model_name, body.return_token_ids)
    return await answer(request, state, prepared, shape, body.stream, body.include_usage)


async def answer(request: Request, state: ServerState, prepared: PreparedRequest, shape: ResponseShape,
                 stream_mode: bool, include_usage: bool) -> Response:
    stream = GenerationStream(prepared.prompt_token_ids, prepared.params, arrival_time=time.perf_counter(),
                              loop=asyncio.get_running_loop())
    try:
        state.engine.submit(stream)
    except ServerBusy as busy:
        raise APIError(503, str(busy), code="server_busy", error_type="server_error",
                       headers={"Retry-After": RETRY_AFTER_S}) from busy
    if stream_mode:
        return StreamingResponse(sse_events(state.engine, stream, shape, include_usage),
                                 media_type="text/event-stream")
    return await whole_answer(request, state.engine, stream, shape)


async def sse_events(engine: EngineThread, stream: GenerationStream, shape: ResponseShape,
                     include_usage: bool) -> AsyncIterator[str]:
    """The SSE body; if the client goes away (Starlette cancels us), the request is aborted."""
    delta, last = Delta(), None
    try:
        async for output in engine_outputs(stream):
            last = output
            yield event(stream_chunk(shape, output, delta))
        if include_usage:
            yield event(usage_chunk(shape, last))
        yield DONE
    except StreamFailed as failure:
        yield event(error_body(failure.message, "server_error", None, failure.code))
        yield DONE
    finally:
        if last is None or not last.finished:
            engine.abort(stream)


async def whole_answer(request: Request, engine: EngineThread, stream: GenerationStream,
                       shape: ResponseShape) -> Response:
    """The finished request as one body, unless the client disconnects first (then: abort)."""
    result = asyncio.ensure_future(last_output(stream))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
            engine.abort(stream)
    if not result.done() or result.cancelled():
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    try:
        return JSONResponse(full_response(shape, result.result()))
    except StreamFailed as failure:
        raise APIError(failure.status, failure.message, code=failure.code,
                       error_type="invalid_request_error" if failure.status == 400 else "server_error") from failure


async def last_output(stream: GenerationStream) -> Any:
    output = None
    async for output in engine_outputs(stream):
        pass
    return output


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
