"""Run the app under uvicorn, with a clean SIGTERM / SIGINT.

On the signal the server stops accepting connections (uvicorn), refuses new requests and aborts
every request in flight (their streams end with ``finish_reason: "abort"`` and ``[DONE]``, their
KV blocks return), waits up to ``graceful_shutdown_s`` for connections to close, stops the engine
thread and returns: ``python serve.py`` exits 0. (Plain uvicorn would wait for every stream to
finish generating, then re-raise the signal, so the process would die *by* SIGTERM.)
"""
from __future__ import annotations

import signal
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` whose exit signal also aborts the requests in flight."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.engine = app.state.servelab.engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler must not take locks the interrupted code may hold: hand off to a thread.
        threading.Thread(target=self.engine.begin_shutdown, name="servelab-shutdown", daemon=True).start()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: do not wait for connections
        self.should_exit = True


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info",
                graceful_shutdown_s: float = 5.0) -> GracefulServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_shutdown_s, access_log=False)
    return GracefulServer(config, app)
