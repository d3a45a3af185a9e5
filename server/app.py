"""The FastAPI app over one engine: routes, the engine thread's lifetime, OpenAI-shaped errors.

``build_app(llm, ...)`` wires an already built :class:`engine.LLM` (the engine thread starts with
the app and stops with it). Every error leaves as OpenAI's error object: request-validation
failures (malformed JSON, wrong types, out-of-range fields) become 400 naming the field instead
of FastAPI's 422; :class:`~server.protocol.APIError` carries its own status (400, 401, 503...).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from server.engine_thread import EngineThread
from server.metrics import ServerMetrics
from server.protocol import APIError, error_body
from server.requests import ModelLimits
from server.routes import ServerState, open_routes, v1


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """The first validation error as (message, param): ``max_tokens: Input should be >= 1 (got 0)``."""
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg')} ({first.get('ctx', {}).get('error', '')})", None
    param = ".".join(location) or None
    got = first.get("input")
    shown = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"{param or 'body'}: {first.get('msg')}{shown}", param


async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    message, param = validation_message(error)
    return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_value"), status_code=400)


async def api_error(_: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def build_app(llm: Any, served_model_name: str, api_key: str | None = None, max_waiting: int = 256) -> FastAPI:
    """An app serving ``llm`` under ``served_model_name``; its engine thread runs while the app does."""
    metrics = ServerMetrics(served_model_name)
    engine = EngineThread(llm, metrics, max_waiting)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="servelab", lifespan=lifespan)
    app.state.servelab = ServerState(engine, ModelLimits.of(llm, served_model_name), metrics, api_key or None)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(APIError, api_error)
    app.include_router(open_routes)
    app.include_router(v1)
    return app
