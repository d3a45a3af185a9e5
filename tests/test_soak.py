"""Soak (experiments/bench/soak.py): many requests through one engine, nothing lost, the pool full at the
end, resident memory flat after warm-up. The fast test is a short soak; the 10,000-request one is slow."""
from __future__ import annotations

import pytest

from experiments.bench.soak import SoakConfig, run_soak


def test_short_soak_loses_nothing_and_returns_every_block():
    # run_soak raises if a request is lost, finishes twice or with the wrong tokens count,
    # or if any block is still held at the end
    result = run_soak(SoakConfig(requests=300, rss_samples=5))
    assert result.finished + result.aborted == 300 and result.aborted > 0
    assert result.preemptions > 0 and result.prefix_hit_tokens > 0 and result.prefix_evicted_blocks > 0


@pytest.mark.slow  # 10,000 requests: about 1-2 minutes alone on 2 cores
def test_soak_10k_requests_memory_flat_after_warmup():
    result = run_soak(SoakConfig())
    assert result.finished + result.aborted == 10_000
    assert result.preemptions > 0 and result.prefix_evicted_blocks > 0
    assert result.rss_growth_after_warmup_mib < 16, result.summary_lines()
