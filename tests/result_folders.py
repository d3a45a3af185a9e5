"""Small hand-made run and sweep folders (summary.json, requests.csv, steps.csv, .hydra/overrides.yaml,
config.yaml) with known numbers, for tests of the readers of results: report.html, compare."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from experiments.results.files import REQUEST_COLUMNS, STEP_COLUMNS

ENVIRONMENT = {"device": "cpu", "torch": "2.13.0+cpu", "cpu_model": "Test CPU", "git": {"commit": "abc123", "dirty": False}}


def metrics(concurrency: int, speed: float = 1.0) -> dict[str, float]:
    """Plausible headline metrics of a run at ``concurrency`` users, ``speed`` times as fast as the base."""
    rate = speed * concurrency / (1 + 0.1 * concurrency)
    return {
        "num_requests": 8, "duration_s": 8 / rate, "request_throughput": rate, "output_throughput": 20 * rate,
        "total_token_throughput": 50 * rate, "goodput": rate * (1.0 if concurrency < 8 else 0.5),
        "num_good_requests": 8 if concurrency < 8 else 4,
        "ttft_s_mean": 0.1 * concurrency / speed, "ttft_s_p50": 0.09 * concurrency / speed, "ttft_s_p99": 0.2 * concurrency / speed,
        "tpot_s_mean": 0.01 * (1 + 0.2 * concurrency) / speed, "tpot_s_p50": 0.01 * (1 + 0.2 * concurrency) / speed,
        "tpot_s_p99": 0.02 * (1 + 0.2 * concurrency) / speed, "itl_s_p50": 0.011 * (1 + 0.2 * concurrency) / speed,
        "itl_s_p99": 0.03 * (1 + 0.2 * concurrency) / speed, "e2e_s_p50": 0.5 * concurrency / speed,
        "e2e_s_p99": 0.9 * concurrency / speed, "prefix_hit_tokens": 0, "forward_passes": 40,
    }


def write_run(folder: Path, run_metrics: dict[str, Any], overrides: list[str], *, status: str = "ok",
              concurrency: int | None = None, engine: str = "servelab", kv: bool = True) -> Path:
    """One run folder as ``run.py`` leaves it; ``kv=False``: steps.csv without KV numbers (an HTTP peer)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".hydra").mkdir(exist_ok=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (folder / "config.yaml").write_text(yaml.safe_dump({"engine": {"name": engine}, "seed": 0, "overrides": overrides}))
    summary = {"status": status, "error": None if status == "ok" else "RuntimeError: the server died",
               "run": {"engine": engine, "workload": "burst", "concurrency": concurrency, "overrides": " ".join(overrides)},
               "slo": {"ttft_s": 2.0, "tpot_s": 0.2, "e2e_s": None}, "metrics": run_metrics if status == "ok" else {},
               "environment": ENVIRONMENT}
    (folder / "summary.json").write_text(json.dumps(summary))
    if status != "ok":
        return folder
    ttft = run_metrics.get("ttft_s_p50", 0.1)
    requests = [{"request_id": i, "ttft_s": ttft * (0.5 + i / 8), "itl_mean_s": 0.01 * (1 + i / 8), "output_tokens": 20}
                for i in range(8)]
    pd.DataFrame(requests, columns=REQUEST_COLUMNS).to_csv(folder / "requests.csv", index=False)
    steps = [{"step": i, "end_time": 0.1 * i, "kv_used_tokens": 16 * i if kv else None,
              "kv_reserved_tokens": 32 * i if kv else None, "num_seqs": 2} for i in range(10)]
    pd.DataFrame(steps, columns=STEP_COLUMNS).to_csv(folder / "steps.csv", index=False)
    return folder


def write_sweep(root: Path, levels: tuple[int, ...] = (1, 4, 16), extra: list[str] | None = None,
                speed: float = 1.0, kv: bool = True) -> Path:
    """A sweep folder over ``workload.concurrency=levels``, one job folder per level (0, 1, 2...)."""
    for job, level in enumerate(levels):
        write_run(root / str(job), metrics(level, speed), [*(extra or []), f"workload.concurrency={level}"],
                  concurrency=level, kv=kv)
    return root
