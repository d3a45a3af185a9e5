"""Soak test: thousands of requests through one engine, checking nothing is lost or leaked.

    python -m experiments.bench.soak                      # 10,000 requests, tiny model, prefix + preemptive, small pool
    python -m experiments.bench.soak --requests 2000 --out results/soak   # shorter; also writes soak.json

Requests arrive as a Poisson process counted in engine steps (``--rate`` arrivals per step on
average: no sleeping, so the run is as fast as the engine and repeatable for a seed). Prompts
start with one of a few shared system prompts (prefix-cache hits and evictions), lengths and
``max_tokens`` are random, and a small share of requests is aborted mid-flight. The pool is
small, so the preemptive scheduler preempts. At the end:

* every request finished exactly once: ``length`` with exactly ``max_tokens`` tokens, or
  ``abort`` if it was aborted (nothing lost, nothing duplicated);
* the block pool is full again (no leaked block, no reference left);
* resident memory (RSS, ``/proc/self/statm``) did not grow after warm-up: the largest sample
  after the warm-up share of requests minus the sample at its end is reported and bounded.

``prepack`` follows the engine's default (``auto``: oneDNN-packed linears on CPU float32). oneDNN
keeps a primitive per distinct number of rows it sees; ``engine/weight_copies.py`` pads rows to a few
buckets per octave so that state stays small (docs/reliability.md has the before/after).

The engine keeps a per-step log (``LLM.step_records``) that its consumer drains, as the server's
metrics loop does; the soak folds it into counters every step.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine import LLM, SamplingParams
from experiments.results.files import write_json

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class SoakConfig:
    """One soak run (defaults: the documented 10,000-request run)."""

    requests: int = 10_000
    rate: float = 0.6                # mean arrivals per engine step (Poisson)
    model: str = "tiny"
    cache: str = "prefix"
    scheduler: str = "preemptive"
    block_size: int = 16
    capacity_tokens: int = 512       # 32 blocks: a few long requests fill it, so preemption happens
    max_num_seqs: int = 16
    system_prompts: int = 4          # shared prefixes (two full blocks each)
    system_prompt_len: int = 32
    question_len: tuple[int, int] = (4, 48)
    max_tokens: tuple[int, int] = (4, 32)
    abort_fraction: float = 0.01     # share of requests aborted a few steps after they arrive
    warmup_fraction: float = 0.2     # RSS growth is measured after this share of requests finished
    rss_samples: int = 50
    threads: int = 1                 # torch intra-op threads (the tiny model's ops are too small for more)
    prepack: bool | str = "auto"     # LLM(prepack=...): the engine's default; see the module docstring
    seed: int = 0


@dataclass
class SoakResult:
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prefix_evicted_blocks: int = 0
    wall_s: float = 0.0
    rss_mib: list[tuple[int, float]] = field(default_factory=list)  # (requests finished, RSS MiB)
    rss_after_warmup_mib: float | None = None
    rss_end_mib: float | None = None
    rss_growth_after_warmup_mib: float | None = None

    def summary_lines(self) -> list[str]:
        return [
            f"requests finished {self.finished} (+{self.aborted} aborted) in {self.steps} steps, {self.wall_s:.1f} s",
            f"output tokens {self.output_tokens}, preemptions {self.preemptions}, prefix hit tokens "
            f"{self.prefix_hit_tokens}, prefix blocks evicted {self.prefix_evicted_blocks}",
            f"RSS after warm-up {self.rss_after_warmup_mib:.1f} MiB, at the end {self.rss_end_mib:.1f} MiB, "
            f"largest growth after warm-up {self.rss_growth_after_warmup_mib:+.1f} MiB",
        ]


def rss_mib() -> float:
    """Resident set size of this process (``/proc/self/statm``, Linux)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE_SIZE / 2**20


class RequestFactory:
    """Seeded prompts: a shared system prompt plus a random question; random max_tokens."""

    def __init__(self, config: SoakConfig, vocab_size: int, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng
        self.vocab_size = vocab_size
        self.system_prompts = [self.tokens(config.system_prompt_len) for _ in range(config.system_prompts)]

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(3, self.vocab_size, size=n).tolist()  # ids 0-2 are special in the tiny model

    def make(self) -> tuple[list[int], SamplingParams]:
        system = self.system_prompts[self.rng.integers(len(self.system_prompts))]
        question = self.tokens(int(self.rng.integers(*self.config.question_len, endpoint=True)))
        max_tokens = int(self.rng.integers(*self.config.max_tokens, endpoint=True))
        return system + question, SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_soak(config: SoakConfig) -> SoakResult:
    torch.set_num_threads(config.threads)
    rng = np.random.default_rng(config.seed)
    llm = LLM(model=config.model, cache=config.cache, scheduler=config.scheduler, device="cpu",
              block_size=config.block_size, capacity_tokens=config.capacity_tokens, max_num_seqs=config.max_num_seqs,
              seed=config.seed, prepack=config.prepack)
    factory = RequestFactory(config, llm.model_config.vocab_size, rng)
    # only live requests are tracked (the soak's own bookkeeping must not grow with the run)
    expected_tokens: dict[int, int] = {}
    abort_at_step: dict[int, int] = {}
    to_abort: set[int] = set()
    result = SoakResult()
    sample_every = max(1, config.requests // config.rss_samples)
    warmup_done = int(config.requests * config.warmup_fraction)
    added = 0
    start = time.perf_counter()
    while added < config.requests or llm.has_unfinished():
        arrivals = min(int(rng.poisson(config.rate)), config.requests - added)
        for _ in range(arrivals):
            prompt, params = factory.make()
            request_id = llm.add_request(prompt, params)
            expected_tokens[request_id] = params.max_tokens
            if rng.random() < config.abort_fraction:
                abort_at_step[request_id] = result.steps + int(rng.integers(0, 8))
            added += 1
        for request_id, step in list(abort_at_step.items()):
            if step <= result.steps:
                del abort_at_step[request_id]
                if request_id in expected_tokens and llm.abort_request(request_id):
                    to_abort.add(request_id)
        for output in llm.step():
            if output.finished:
                check_finished(output, expected_tokens, to_abort, result)
                if (result.finished + result.aborted) % sample_every == 0:
                    result.rss_mib.append((result.finished + result.aborted, rss_mib()))
        fold_step_records(llm, result)
    result.wall_s = time.perf_counter() - start
    if expected_tokens:
        raise AssertionError(f"{len(expected_tokens)} requests never finished: {sorted(expected_tokens)[:10]}")
    if result.finished + result.aborted != config.requests:
        raise AssertionError(f"{result.finished + result.aborted} requests finished of {config.requests} added")
    llm.free_blocks_check()
    llm.cache.pool.check_all_free()
    result.prefix_evicted_blocks = llm.cache.stats().prefix_evicted_blocks
    after_warmup = [rss for count, rss in result.rss_mib if count >= warmup_done]
    result.rss_after_warmup_mib, result.rss_end_mib = after_warmup[0], after_warmup[-1]
    result.rss_growth_after_warmup_mib = max(after_warmup) - after_warmup[0]
    return result


def check_finished(output, expected_tokens: dict[int, int], to_abort: set[int], result: SoakResult) -> None:
    """Each request finishes once: aborted ones with ``abort``, the rest with all their tokens."""
    request_id = output.request_id
    if request_id not in expected_tokens:
        raise AssertionError(f"request {request_id} finished twice, or was never added")
    max_tokens = expected_tokens.pop(request_id)
    if request_id in to_abort:
        to_abort.discard(request_id)
        if output.finish_reason != "abort":
            raise AssertionError(f"aborted request {request_id} finished with {output.finish_reason}")
        result.aborted += 1
        return
    if output.finish_reason != "length" or len(output.token_ids) != max_tokens:
        raise AssertionError(f"request {request_id}: {output.finish_reason} with {len(output.token_ids)} tokens, "
                             f"expected length with {max_tokens}")
    result.finished += 1
    result.output_tokens += len(output.token_ids)


def fold_step_records(llm: LLM, result: SoakResult) -> None:
    """Consume the engine's per-step log into counters (the log would otherwise grow forever)."""
    for record in llm.step_records:
        result.steps += 1
        result.preemptions += record.num_preempted
        result.prefix_hit_tokens += record.prefix_hit_tokens
    llm.step_records.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=SoakConfig.requests)
    parser.add_argument("--rate", type=float, default=SoakConfig.rate, help="mean arrivals per engine step")
    parser.add_argument("--capacity-tokens", type=int, default=SoakConfig.capacity_tokens)
    parser.add_argument("--seed", type=int, default=SoakConfig.seed)
    parser.add_argument("--prepack", default="auto", help="LLM(prepack=...): auto (the engine's default) | false | true")
    parser.add_argument("--out", type=Path, default=None, help="folder for soak.json (config, counters, RSS samples)")
    args = parser.parse_args(argv)
    prepack = {"false": False, "true": True}.get(args.prepack, args.prepack)
    config = SoakConfig(requests=args.requests, rate=args.rate, capacity_tokens=args.capacity_tokens, seed=args.seed,
                        prepack=prepack)
    result = run_soak(config)
    print("\n".join(result.summary_lines()))
    if args.out is not None:
        print(f"wrote {write_json({'config': asdict(config), 'result': asdict(result)}, args.out / 'soak.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
