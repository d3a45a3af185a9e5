"""What a server says about itself while it is measured: its Prometheus ``/metrics``.

The HTTP client cannot see a remote engine's steps, but any server exporting vLLM's metric names
(vLLM itself, servelab's ``serve.py``) tells it. :class:`MetricsSampler` scrapes ``/metrics`` before
the run, every ``interval_s`` during it, and after it; :meth:`MetricsSampler.summary` reports the
counters' increase over the run (preemptions, prefix-cache hits and queries, prompt and
generation tokens) and the peaks of the gauges (KV usage, running and waiting requests). A server
without ``/metrics`` (or without these names) yields an empty summary.
"""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {  # summary key -> vLLM counter (summed over label sets)
    "server_preemptions": "vllm:num_preemptions_total",
    "server_prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "server_prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "server_prompt_tokens": "vllm:prompt_tokens_total",
    "server_generation_tokens": "vllm:generation_tokens_total",
}
GAUGES = {  # summary key -> vLLM gauge whose peak over the run is reported
    "server_peak_kv_usage_perc": "vllm:kv_cache_usage_perc",
    "server_peak_running": "vllm:num_requests_running",
    "server_peak_waiting": "vllm:num_requests_waiting",
}


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample of each metric name over its label sets (``vllm:...`` names only)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def metrics_url(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port/metrics``."""
    root = base_url.rstrip("/")
    return f"{root.removesuffix('/v1')}/metrics"


class MetricsSampler:
    """Scrapes ``/metrics`` around and during a run (see the module docstring)."""

    def __init__(self, base_url: str, interval_s: float = 0.5, timeout_s: float = 5.0) -> None:
        self.url = metrics_url(base_url)
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.before: dict[str, float] | None = None
        self.after: dict[str, float] | None = None
        self.peaks: dict[str, float] = {}
        self.task: asyncio.Task | None = None

    async def scrape(self) -> dict[str, float] | None:
        try:
            async with aiohttp.ClientSession(timeout=self.timeout) as session, session.get(self.url) as response:
                if response.status != 200:
                    return None
                values = parse_metrics(await response.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        for name in GAUGES.values():
            if name in values:
                self.peaks[name] = max(self.peaks.get(name, 0.0), values[name])
        return values

    async def start(self) -> None:
        self.before = await self.scrape()
        if self.before is not None and self.interval_s > 0:
            self.task = asyncio.create_task(self.poll())

    async def poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.after = await self.scrape() if self.before is not None else None

    def summary(self) -> dict[str, Any]:
        if self.before is None or self.after is None:
            return {}
        out: dict[str, Any] = {}
        for key, name in COUNTERS.items():
            if name in self.after:
                out[key] = self.after[name] - self.before.get(name, 0.0)
        for key, name in GAUGES.items():
            if name in self.peaks:
                out[key] = self.peaks[name]
        return out
