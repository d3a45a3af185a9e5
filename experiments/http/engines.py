"""HTTP "engines" for the harness: the run's workload goes over HTTP instead of in-process.

* ``engine=openai`` (:class:`OpenAIEngine`): any OpenAI-compatible server already running at
  ``engine.base_url`` (servelab, vLLM, SGLang, llama.cpp). ``model=<name>`` still matters: the
  workload's token-id prompts are drawn from that model's vocabulary (its special ids avoided),
  and the chat endpoint decodes them with its tokenizer; it must be the model the server serves.
* ``engine=servelab_http`` (:class:`ServelabHTTPEngine`): starts ``serve.py`` with the run's own
  strategy config on a free loopback port (:mod:`experiments.http.server_process`), measures it the
  same way, and stops it. Beside an ``engine=servelab`` run of the same config, it shows what the
  HTTP layer costs.

Both send the load with :mod:`experiments.http.client` (vLLM's benchmark rules), scrape the
server's ``/metrics`` around the run (:mod:`experiments.http.scrape`), and add
``vllm_bench.json`` (:mod:`experiments.http.vllm_bench`) to the usual result files. ``job.py`` calls
:meth:`OpenAIEngine.drive` instead of the in-process driver for them.
"""
from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import aiohttp
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from engine.loader import checkpoint_for_spec
from engine.model_config import ModelConfig
from engine.tokenizer import decode, load_tokenizer, require_tokenizer
from experiments.harness.driver import DriveResult
from experiments.harness.environment import logged_applied_options
from experiments.harness.follow_ups import FollowUps
from experiments.http.client import HTTPTarget, drive_result, run_load, warm_up
from experiments.harness.metrics import SLO
from experiments.http.server_process import (
    ServerError,
    ServerProcess,
    exit_status,
    free_loopback_port,
    server_config,
    start_serve_py,
)
from experiments.http.scrape import MetricsSampler
from experiments.http.vllm_bench import vllm_bench_result
from experiments.harness.workloads import WorkloadRequest


async def first_served_model(base_url: str, api_key: str | None, timeout_s: float) -> str:
    """The first id of ``GET /v1/models`` (what ``vllm bench serve`` uses without ``--model``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(f"{base_url.rstrip('/')}/models", headers=headers) as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]


def run_folder() -> Path:
    """The Hydra job's output folder (a temporary one outside Hydra)."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(tempfile.mkdtemp(prefix="servelab-run-"))


class OpenAIEngine:
    """Measures an OpenAI-compatible server (see the module docstring)."""

    backend_names = {"completions": "openai", "chat": "openai-chat"}   # vLLM's --backend names

    def __init__(self, cfg: DictConfig, target: HTTPTarget, metrics_interval_s: float) -> None:
        if target.endpoint not in self.backend_names:
            raise ValueError(f"engine.endpoint must be 'completions' or 'chat', got {target.endpoint!r}")
        self.cfg = cfg
        self.target = target
        self.metrics_interval_s = metrics_interval_s
        self.step_records: list[Any] = []   # a remote engine's steps are not visible

    @classmethod
    def from_config(cls, cfg: DictConfig, base_url: str, model: str | None = None, endpoint: str = "completions",
                    api_key: str | None = None, timeout_s: float = 600.0, extra_body: Any = None,
                    metrics_interval_s: float = 0.5) -> "OpenAIEngine":
        if model is None:
            model = asyncio.run(first_served_model(base_url, api_key, timeout_s))
        extra = OmegaConf.to_container(extra_body, resolve=True) if isinstance(extra_body, DictConfig) else extra_body
        target = HTTPTarget(base_url, model, endpoint, api_key, timeout_s, dict(extra or {}))
        return cls(cfg, target, metrics_interval_s)

    @cached_property
    def checkpoint(self) -> Path:
        return checkpoint_for_spec(self.cfg.model)

    @cached_property
    def model_config(self) -> ModelConfig:
        """The served model's config (vocabulary, special ids) from ``cfg.model``'s checkpoint."""
        return ModelConfig.from_hf_config(json.loads((self.checkpoint / "config.json").read_text()))

    @cached_property
    def tokenizer(self) -> Any | None:
        """The served model's tokenizer (chat workloads, special ids), or ``None``."""
        return load_tokenizer(self.checkpoint)

    def chat_messages(self, requests: Sequence[WorkloadRequest]) -> dict[str, list[dict[str, str]]]:
        """For the chat endpoint: each request's conversation (a chat workload's own messages, or
        a token-id prompt decoded with the model's tokenizer as one user message)."""
        if self.target.endpoint != "chat":
            return {}
        if any(not r.messages and not r.text for r in requests):
            require_tokenizer(self.tokenizer, "engine.endpoint=chat with a token-id workload")
        return {r.request_id: list(r.messages)
                or [{"role": "user", "content": r.text or decode(self.tokenizer, r.prompt_token_ids)}]
                for r in requests}

    def drive(self, requests: Sequence[WorkloadRequest], max_concurrency: int | None,
              warmup: Sequence[WorkloadRequest], progress: bool = True,
              follow_ups: FollowUps | None = None) -> DriveResult:
        """Warm up, then send ``requests`` (and their ``follow_ups``) with their arrival offsets;
        returns the run's records."""
        conversations = self.chat_messages([*warmup, *requests])

        async def measured() -> tuple[Any, dict[str, Any]]:
            await warm_up(self.target, warmup, conversations)
            sampler = MetricsSampler(self.target.base_url, self.metrics_interval_s)
            await sampler.start()
            try:
                run = await run_load(self.target, requests, max_concurrency, conversations, progress, follow_ups)
            finally:
                await sampler.stop()
            return run, sampler.summary()

        run, server_metrics = asyncio.run(measured())
        result = drive_result(run)
        if requests and not result.records:
            raise RuntimeError(f"all {len(requests)} requests failed; the first: {result.failures[0]['error']}")
        result.extra_metrics.update(server_metrics)
        workload = self.cfg.get("workload", {})
        all_at_once = all(r.arrival_offset_s == 0 for r in requests)
        result.extra_json["vllm_bench.json"] = vllm_bench_result(
            run.outcomes, run.wall_s, backend=self.backend_names[self.target.endpoint], model_id=self.target.model,
            tokenizer_id=str(self.checkpoint),
            request_rate=workload.get("request_rate", workload.get("rate", "inf" if all_at_once else None)),
            burstiness=workload.get("burstiness", 1.0), max_concurrency=max_concurrency,
            slo=SLO(**OmegaConf.to_container(self.cfg.slo, resolve=True)) if "slo" in self.cfg else SLO(),
        )
        return result

    def close(self) -> None:
        """Nothing to release: the server is not ours."""


class StartedServerEngine(OpenAIEngine):
    """A server this run started (:class:`ServerProcess`) and stops in :meth:`close`."""

    def __init__(self, cfg: DictConfig, process: ServerProcess, target: HTTPTarget, metrics_interval_s: float) -> None:
        super().__init__(cfg, target, metrics_interval_s)
        self.process = process

    @property
    def server_command(self) -> list[str]:
        """The server's command line (``summary.json``'s ``environment.server_command``)."""
        return self.process.command

    def close(self) -> None:
        code = self.process.stop()
        if code not in (0, None):
            raise ServerError(f"{self.process.name} {exit_status(code)}", self.process.log_tail())


class ServelabHTTPEngine(StartedServerEngine):
    """servelab's own server, started for this run with the run's config (see the module docstring)."""

    @cached_property
    def server_applied_options(self) -> dict[str, Any] | None:
        """The options the server's engine applied (attention backend, quantized weights, ...), as
        serve.py logged them at startup; ``summary.json``'s environment records them."""
        return logged_applied_options(self.process.log_path)

    @classmethod
    def from_config(cls, cfg: DictConfig, endpoint: str = "completions", timeout_s: float = 600.0,
                    extra_body: Any = None, metrics_interval_s: float = 0.5, startup_timeout_s: float = 300.0,
                    stop_timeout_s: float = 15.0, server: Any = None, **engine_options: Any) -> "ServelabHTTPEngine":
        """``engine_options`` are the engine's performance options (conf/engine/servelab.yaml);
        ``server`` the server options (conf/server/default.yaml fields)."""
        checkpoint_for_spec(cfg.model)  # build a random checkpoint here, once, before the server needs it
        server_options = OmegaConf.to_container(server, resolve=True) if isinstance(server, DictConfig) else dict(server or {})
        name = server_options["served_model_name"] = server_options.get("served_model_name") or cfg.model.name
        run_dir = run_folder() / "server"
        config = server_config(cfg, engine_options, server_options, free_loopback_port(), run_dir)
        process = start_serve_py(config, run_dir, startup_timeout_s, stop_timeout_s)
        extra = OmegaConf.to_container(extra_body, resolve=True) if isinstance(extra_body, DictConfig) else extra_body
        target = HTTPTarget(process.base_url, name, endpoint, None, timeout_s, dict(extra or {}))
        return cls(cfg, process, target, metrics_interval_s)
