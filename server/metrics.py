"""Prometheus metrics under vLLM's names, so dashboards and scrapers built for vLLM work here.

One :class:`ServerMetrics` per app, each with its own ``CollectorRegistry`` (two servers in one
process, as in tests, do not share counters). Every series carries the label ``model_name``,
as vLLM's do. Counters are exposed with prometheus_client's ``_total`` suffix, exactly as vLLM's
(``vllm:prompt_tokens_total``, ``vllm:request_success_total{finished_reason=...}``,
``vllm:num_preemptions_total``, ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``).

Only the engine thread writes (prometheus_client metrics are thread-safe); ``/metrics`` reads.
Definitions (engine clock, seconds):

* ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: the scheduler's running set
  and queue after the last step;
* ``vllm:kv_cache_usage_perc``: fraction of KV blocks in use, 0..1 (cached blocks nobody holds
  count as free, as in vLLM);
* ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``: prompt tokens of requests that
  got their first token; generated tokens;
* ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: prompt tokens looked up
  / served from the prefix cache, counted when a request gets its first token;
* ``vllm:num_preemptions_total``: preemptions by the scheduler;
* histograms: TTFT (first token - arrival), inter-token latency (gap between consecutive tokens
  of one request), E2E (finish - arrival), queue time (first scheduled - arrival); arrival is
  when the HTTP handler received the request.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's bucket boundaries (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's Prometheus series for one served model."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, label, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, label, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the engine's running set.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests queued in the scheduler.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions by the scheduler.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled step.",
                                    REQUEST_BUCKETS)

    def observe_output(self, output: Any, tokens_seen: int) -> None:
        """One request's output of one step; ``tokens_seen`` = its tokens counted before."""
        times = output.token_times
        new = len(output.token_ids) - tokens_seen
        if new > 0:
            self.generation_tokens.inc(new)
            if tokens_seen == 0:
                self.first_token(output)
            start = max(tokens_seen, 1)
            for earlier, later in zip(times[start - 1:], times[start:]):
                self.itl.observe(later - earlier)
        if output.finished:
            self.success.labels(self.model_name, output.finish_reason or "unknown").inc()
            if output.finish_time is not None:
                self.e2e.observe(output.finish_time - output.arrival_time)

    def first_token(self, output: Any) -> None:
        prompt = len(output.prompt_token_ids)
        self.prompt_tokens.inc(prompt)
        self.prefix_queries.inc(prompt)
        self.prefix_hits.inc(output.num_cached_tokens)
        if output.first_token_time is not None:
            self.ttft.observe(output.first_token_time - output.arrival_time)
        if output.first_scheduled_time is not None:
            self.queue_time.observe(output.first_scheduled_time - output.arrival_time)

    def observe_engine(self, scheduler: Any, cache_stats: Any, new_steps: Sequence[Any]) -> None:
        """Gauges after a step, and the preemptions of the steps run since the last call."""
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        used_blocks = cache_stats.num_blocks - cache_stats.num_free_blocks
        self.kv_usage.set(used_blocks / cache_stats.num_blocks if cache_stats.num_blocks else 0.0)
        preempted = sum(step.num_preempted for step in new_steps)
        if preempted:
            self.preemptions.inc(preempted)

    def exposition(self) -> bytes:
        """The Prometheus text format of every series."""
        return generate_latest(self.registry)
