"""Recover a stored run's step shapes by replaying its scheduling in the simulator.

A run's ``steps.csv`` records the shape of every step that its engine version knew how to
record. When the cost model gains a term (``padded_attention_pairs``: what a dense attention
kernel computes), runs stored before it lack the column; rerunning the real engine is slow and,
on a busy machine, noisy. The batches themselves need no timing to rebuild: the simulator runs
the very same scheduler and cache code (``engine=simulated``), so replaying the run's config
and seeded workload reproduces every step's batch, and with it every shape column.

That holds when the batches do not depend on the clock: closed-loop runs (``burst``: every
request sent at t=0, the client cap released by finishes, not by time) do not; open-loop
arrivals (``poisson``, ``shared_prefix`` with arrival gaps) do, because which requests have
arrived at a step depends on how long earlier steps took. So the replay is **checked**: every
column the run did record (sequences, prefill / decode / wasted tokens, sampled rows, context
read, causal pairs) must equal the replay's, step by step; if any differs, nothing is returned
and the caller is told to rerun the real engine.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.harness.driver import drive, warm_up
from experiments.harness.workloads import special_token_ids, tokenize_requests, warmup_requests

#: the columns a replay must reproduce exactly before its other columns are trusted
CHECKED = ("num_seqs", "num_prefill_tokens", "num_decode_tokens", "num_wasted_slots", "num_sampled",
           "context_tokens", "prefill_attention_pairs")
#: any hardware will do: the replay's times are thrown away, only its batches are kept
UNITS = {"_target_": "simulator.hardware.Hardware", "name": "replay", "peak_tflops": 1.0, "bandwidth_tbps": 1.0}


def replay_steps(cfg: DictConfig) -> pd.DataFrame:
    """The measured part of a run, replayed on a virtual clock: one row per step, the shape columns."""
    from simulator.llm import SimulatedLLM

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.hardware = UNITS
    engine = SimulatedLLM.from_config(cfg, kv_capacity=None)  # the run's own cache.capacity_tokens
    special = special_token_ids(engine.model_config, engine.tokenizer)
    requests = instantiate(cfg.workload, vocab_size=engine.model_config.vocab_size, special_token_ids=special)
    warm_up(engine, warmup_requests(engine.model_config.vocab_size, special, cfg.driver.warmup_requests))
    result = drive(engine, tokenize_requests(requests, engine.tokenizer), cfg.driver.max_concurrency, progress=False)
    return pd.DataFrame(result.steps)


def recovered_shapes(run_dir: Path, steps: pd.DataFrame) -> pd.DataFrame:
    """``steps`` with the shape columns it lacks filled in from a checked replay of ``run_dir``.

    Raises ``ValueError`` if the replay's batches differ from the recorded ones (the run's
    scheduling depended on its timing).
    """
    replayed = replay_steps(OmegaConf.load(Path(run_dir) / "config.yaml"))
    if len(replayed) != len(steps):
        raise ValueError(f"{run_dir}: the replay took {len(replayed)} steps, the run {len(steps)}: its batches "
                         "depended on its timing (open-loop arrivals); rerun it to record every shape column")
    for column in CHECKED:
        differs = (replayed[column].to_numpy() != steps[column].to_numpy()).nonzero()[0]
        if differs.size:
            raise ValueError(f"{run_dir}: the replay's {column} differs from the run's at step "
                             f"{int(steps.step.iloc[differs[0]])}: its batches depended on its timing (open-loop "
                             "arrivals); rerun it to record every shape column")
    missing = [c for c in replayed.columns if c not in steps.columns or steps[c].isna().any()]
    filled = steps.copy()
    for column in missing:
        filled[column] = replayed[column].to_numpy()
    return filled

