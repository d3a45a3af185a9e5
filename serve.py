"""servelab's server: compose the same config as run.py, build the engine, serve it over HTTP.

    python serve.py                                        # default model and strategies on 127.0.0.1:8000
    python serve.py server.port=8123 cache=prefix scheduler=preemptive
    python serve.py model=tiny server.api_key=secret

Endpoints (OpenAI's shapes): POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /metrics (Prometheus, vLLM's metric names). SIGTERM / Ctrl-C aborts the requests
in flight and exits 0. See server/ for how it works and conf/server/default.yaml for the options.
"""
from __future__ import annotations

import logging

import hydra
from fastapi import FastAPI
from hydra.utils import instantiate
from omegaconf import DictConfig

from engine.sampling_params import SamplingParams
from server.app import build_app
from server.launch import make_server

log = logging.getLogger(__name__)


def app_from_config(cfg: DictConfig) -> FastAPI:
    """Build the engine the config describes, warm it up, and wrap it in the app."""
    llm = instantiate(cfg.engine)(cfg)
    if not hasattr(llm, "abort_request"):
        raise ValueError(f"engine={cfg.engine._target_} cannot be served: serve.py serves servelab's engine "
                         f"(engine=servelab)")
    warmup = [[1 + (i % (llm.model_config.vocab_size - 1)) for i in range(16)]] * cfg.server.warmup_requests
    if warmup:
        llm.generate(warmup, SamplingParams(max_tokens=2, ignore_eos=True))
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
