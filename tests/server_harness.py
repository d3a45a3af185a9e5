"""Test helpers for the HTTP server: a live uvicorn on 127.0.0.1 (free port) in a thread, metric
scraping, and ways to slow down, hold or break the engine's forward pass (fault injection)."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx2 as httpx  # the HTTP client the openai package ships with
from prometheus_client.parser import text_string_to_metric_families

from server.app import build_app
from server.launch import make_server

STARTUP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(llm: Any, served_model_name: str = "tiny", **options: Any) -> Iterator[str]:
    """Serve ``llm`` on 127.0.0.1 (free port) in a thread; yields the base URL (``http://host:port``)."""
    app = build_app(llm, served_model_name, **options)
    server = make_server(app, "127.0.0.1", free_port(), log_level="warning")
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(15)


def scrape(base_url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{label=value,...}": value}`` (the model_name label left out)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()


def wrap_forward(llm: Any, before: Callable[[], None]) -> Callable[[], None]:
    """Run ``before()`` ahead of every forward pass of ``llm``; returns the undo function."""
    original = llm.runner.execute

    def execute(inputs: Any) -> Any:
        before()
        return original(inputs)

    llm.runner.execute = execute
    return lambda: setattr(llm.runner, "execute", original)
