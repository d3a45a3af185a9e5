"""servelab's server: compose the same config as run.py, build the engine, serve it over HTTP.

    python serve.py                                        # default model and strategies on 127.0.0.1:8000
    python serve.py server.port=8123 cache=prefix scheduler=preemptive
    python serve.py model=tiny server.api_key=secret

Endpoints (OpenAI's shapes): POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /metrics (Prometheus, vLLM's metric names). SIGTERM / Ctrl-C aborts the requests
in flight and exits 0. See server/ for how it works and conf/server/default.yaml for the options.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import hydra
from fastapi import FastAPI
from hydra.utils import instantiate
from omegaconf import DictConfig

from engine.sampling_params import SamplingParams
from experiments.harness.environment import APPLIED_LOG_PREFIX, applied_options
from server.app import build_app
from server.launch import make_server

log = logging.getLogger(__name__)
Built = TypeVar("Built")


def in_passing_thread(build: Callable[[], Built]) -> Built:
    """``build()`` run in a thread that exits when it returns; its result, or its exception.

    Why: every thread that starts OpenMP work gets its own OpenMP thread pool, and libgomp
    throttles the spin-wait of *all* pools once the process holds more OpenMP threads than
    cores. The server steps the engine in its engine thread; had the main thread loaded and
    warmed up the model (prepacking, a forward), its pool would stay alive beside the engine
    thread's, and every parallel region would pay sleeping-thread wake-ups: the same decode
    burst ran 1.5x slower from a second thread than from the thread that built the engine
    (2026-11-30, 2 cores). A pool is released when its thread exits, so building here leaves
    the engine thread the only OpenMP master of the process."""
    result: list[Any] = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            result.append(build())
        except BaseException as error:  # noqa: BLE001 -- re-raised in the caller's thread
            failure.append(error)

    thread = threading.Thread(target=body, name="servelab-build")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def built_engine(cfg: DictConfig) -> Any:
    """The engine the config describes, warmed up (``server.warmup_requests`` short requests)."""
    llm = instantiate(cfg.engine)(cfg)
    if not hasattr(llm, "abort_request"):
        raise ValueError(f"engine={cfg.engine._target_} cannot be served: serve.py serves servelab's engine "
                         f"(engine=servelab)")
    warmup = [[1 + (i % (llm.model_config.vocab_size - 1)) for i in range(16)]] * cfg.server.warmup_requests
    if warmup:
        llm.generate(warmup, SamplingParams(max_tokens=2, ignore_eos=True))
    return llm


def app_from_config(cfg: DictConfig) -> FastAPI:
    """Build the engine the config describes (off the main thread: :func:`in_passing_thread`),
    warm it up, and wrap it in the app."""
    llm = in_passing_thread(lambda: built_engine(cfg))
    log.info("%s%s", APPLIED_LOG_PREFIX, json.dumps(applied_options(llm)))  # read back by experiments/http/engines.py
    name = cfg.server.served_model_name or cfg.model.name
    return build_app(llm, served_model_name=name, api_key=cfg.server.api_key, max_waiting=cfg.server.max_waiting)


@hydra.main(config_path="conf", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    app = app_from_config(cfg)
    server = make_server(app, cfg.server.host, cfg.server.port, cfg.server.log_level, cfg.server.graceful_shutdown_s)
    log.info("serving model %r on http://%s:%d/v1", app.state.servelab.limits.served_model_name,
             cfg.server.host, cfg.server.port)
    server.run()


if __name__ == "__main__":
    main()
