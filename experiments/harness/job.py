"""One run, end to end: build the engine, drive the workload, write every result file.

``run.py`` is the Hydra entry point around :func:`execute`. A failure anywhere is caught,
recorded in ``summary.json`` (``"status": "failed"``, the error, its traceback and, when a server
the run started failed, its log's tail: ``server_log_tail``) and
returned, so a multirun keeps going; ``run.py`` re-raises it for single runs.
"""
from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.harness.driver import drive, warm_up
from experiments.harness.environment import environment
from experiments.harness.follow_ups import FollowUps
from experiments.harness.load_levels import LoadLevel
from experiments.harness.saturation import SaturationRule
from experiments.harness.metrics import SLO, priority_class_metrics, queueing_metrics, request_metrics, step_metrics
from experiments.results.plots import plot_run
from experiments.harness.records import fill_priorities, fill_texts
from experiments.results.files import (
    requests_frame, rows_markdown, sample_answers, steps_frame, summary_markdown, summary_table, write_csv, write_file,
    write_json, write_text_file,
)
from experiments.harness.workloads import instantiate_workload, special_token_ids, tokenize_requests, warmup_requests

log = logging.getLogger(__name__)
LABEL_GROUPS = ("engine", "model", "cache", "scheduler", "attention", "workload")


@dataclass
class JobOutcome:
    summary: dict[str, Any]
    error: BaseException | None = None
    files: list[Path] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.error is not None


def run_labels(cfg: DictConfig, choices: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """What identifies a run in tables: group choices, the common swept knobs, the overrides."""
    labels: dict[str, Any] = {group: choices.get(group) for group in LABEL_GROUPS}
    if labels["engine"] not in ("servelab", "servelab_http", "simulated"):  # peers and remote servers ignore servelab's strategy groups
        labels.update(cache=None, scheduler=None, attention=None)
    if labels["engine"] == "simulated":  # the simulator has no attention backend
        labels["attention"] = None
    # users in flight: the workload's concurrency cap, its number of users (shared_prefix), or the client-side cap
    labels["concurrency"] = (
        OmegaConf.select(cfg, "workload.concurrency", default=None)
        or OmegaConf.select(cfg, "workload.num_users", default=None)
        or OmegaConf.select(cfg, "driver.max_concurrency", default=None)
    )
    labels["block_size"] = OmegaConf.select(cfg, "cache.block_size", default=None)
    labels["capacity_tokens"] = OmegaConf.select(cfg, "cache.capacity_tokens", default=None)
    labels["max_num_seqs"] = OmegaConf.select(cfg, "scheduler.max_num_seqs", default=None)
    labels["device"] = cfg.get("device")
    labels["dtype"] = cfg.get("dtype")
    labels["seed"] = cfg.get("seed")
    if labels["engine"] == "simulated":
        labels["hardware"] = choices.get("hardware")
    labels["overrides"] = " ".join(overrides)
    return labels


def _measure(cfg: DictConfig, out_dir: Path, summary: dict[str, Any], load: LoadLevel | None,
             saturation: SaturationRule | None) -> list[Path]:
    files = [write_file(out_dir / "config.yaml", lambda partial: OmegaConf.save(cfg, partial, resolve=True))]
    slo = SLO(**OmegaConf.to_container(cfg.slo, resolve=True))
    setup_start = time.perf_counter()
    engine = instantiate(cfg.engine)(cfg)
    summary["environment"] = environment(engine)
    if summary["run"].get("attention") is not None:  # the backend built (attention=auto chooses one)
        summary["run"]["attention_backend"] = summary["environment"]["attention_backend"]
    try:
        model_config = engine.model_config
        if hasattr(engine, "describe"):  # the simulator: what its times are (projected or calibrated)
            summary["simulation"] = engine.describe()
            summary["run"]["timing"] = summary["simulation"]["timing"]
        tokenizer = getattr(engine, "tokenizer", None)
        special = special_token_ids(model_config, tokenizer)
        workload = instantiate_workload(cfg.workload, model_config.vocab_size, special, tokenizer)
        follow_ups = workload if isinstance(workload, FollowUps) else None  # requests that depend on answers (sessions)
        requests = tokenize_requests(follow_ups.first_requests() if follow_ups else workload, tokenizer)
        max_concurrency = cfg.driver.max_concurrency
        if load is not None:  # a load profile's level: its arrival times and client-side cap
            requests, max_concurrency = load.apply(requests, cfg.seed), load.concurrency
        warmup = warmup_requests(model_config.vocab_size, special, cfg.driver.warmup_requests)
        if hasattr(engine, "drive"):  # HTTP load clients send the workload themselves (experiments/http/engines.py)
            summary["setup_s"] = time.perf_counter() - setup_start
            result = engine.drive(requests, max_concurrency, warmup, progress=cfg.driver.progress,
                                  follow_ups=follow_ups)
        else:
            warm_up(engine, warmup)
            summary["setup_s"] = time.perf_counter() - setup_start
            if hasattr(engine, "start_run"):  # the simulator counts the measured run's steps, not the warm-up's
                engine.start_run()
            result = drive(engine, requests, max_concurrency, progress=cfg.driver.progress, follow_ups=follow_ups)
        if hasattr(engine, "describe"):  # the simulator, after the run: how far it left its calibration
            summary["simulation"] = engine.describe()
            engine.finish_run()  # warns if that is too far; simulator.strict: refuses the run
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    if follow_ups is not None:
        requests = follow_ups.issued()
    fill_texts(result.records, requests, tokenizer)
    fill_priorities(result.records, requests)
    summary["samples"] = sample_answers(result.records)
    summary["wall_s"] = result.wall_s
    summary["metrics"] = {
        **request_metrics(result.records, slo),
        **step_metrics(result.steps),
        **queueing_metrics(result.records, result.steps),
        **priority_class_metrics(result.records),
        **result.extra_metrics,
    }
    if result.failures:
        summary["failures"] = result.failures
    if saturation is not None:
        summary["saturated"] = saturation.check(result.records, result.steps)
    for name, rows in (follow_ups.tables(result.records) if follow_ups else {}).items():  # sessions: per-turn table
        summary[name] = rows
        files.append(write_csv(pd.DataFrame(rows), out_dir / f"{name}.csv"))
        files.append(write_text_file(rows_markdown(rows), out_dir / f"{name}.md"))
    files.extend(write_json(content, out_dir / name) for name, content in result.extra_json.items())
    request_table, step_table = requests_frame(result.records, slo), steps_frame(result.steps)
    files.append(write_csv(request_table, out_dir / "requests.csv"))
    files.append(write_csv(step_table, out_dir / "steps.csv"))
    if cfg.get("plots", True):
        files.extend(plot_run(request_table, step_table, out_dir))
    return files


def execute(cfg: DictConfig, out_dir: Path, choices: dict[str, Any], overrides: list[str],
            load: LoadLevel | None = None, saturation: SaturationRule | None = None) -> JobOutcome:
    """Run one configuration; never raises (the error is in the outcome and in summary.json).

    A load profile passes the ``load`` level of this run (arrival times and client-side cap) and
    the ``saturation`` rule whose verdict goes into ``summary["saturated"]`` (the reason, or None)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"status": "ok", "error": None, "run": run_labels(cfg, choices, overrides),
                               "slo": OmegaConf.to_container(cfg.slo, resolve=True) if "slo" in cfg else None,
                               "metrics": {}}
    if load is not None:
        summary["load"] = load.to_dict()
        summary["run"]["concurrency"] = load.concurrency
    error: BaseException | None = None
    files: list[Path] = []
    try:
        files = _measure(cfg, out_dir, summary, load, saturation)
    except Exception as exc:  # noqa: BLE001 -- recorded, then re-raised by run.py for single runs
        error = exc
        summary.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        if getattr(exc, "log_tail", None):  # a server the run started failed (experiments/http/server_process.py)
            summary["server_log_tail"] = exc.log_tail
        log.error("run failed: %s", summary["error"])
    summary["files"] = [p.name for p in files]
    files.append(write_json(summary, out_dir / "summary.json"))
    files.append(write_text_file(summary_markdown(summary), out_dir / "summary.md"))
    print(f"\n{summary_table(summary)}\n\nresults: {out_dir}")
    return JobOutcome(summary=summary, error=error, files=files)
