"""Fit the simulator's cost model to real runs: ``conf/hardware/<NAME>.yaml`` from ``steps.csv``.

    python -m experiments.calibration.calibrate --suite --name cpu-1thread     # the suite's runs, then the fit
    python -m experiments.calibration.calibrate results/runs/<time> [more run dirs] --name cpu-1thread

``--suite`` runs the fixed plan ``conf/calibration/suite.yaml`` with the real engine first
(:mod:`experiments.calibration.suite`: short runs spanning every term of the cost model, a few
minutes on this project's 2-core machine) and fits on its runs; that is the way to calibrate.

Each run folder holds the resolved ``config.yaml`` (which model, which dtype) and ``steps.csv``
(one row per engine step: its shape and measured duration). The fit is non-negative least
squares of step time on the cost model's terms (:func:`simulator.cost_model.fit_coefficients`),
and the result is written as a hardware file that ``engine=simulated hardware=<NAME>`` uses at
once. Too few steps, or a fit that explains too little (R^2 under ``--min-r2``), is reported and
nothing is written. Steps slowed by other processes on a shared machine (over 1.5x the fit) are
set aside and counted; if more than a quarter are, nothing is written. All runs must be of one model: the fixed step overhead holds its weight read.
The file records, per cost-model feature, the range the kept steps covered (``feature_ranges``:
:mod:`simulator.feature_ranges`); simulated runs count their steps outside it.

The attention term counts the query-key pairs the run's attention backend computes (its
``attention_pairs``: the padded rectangle for the gather backends, causal pairs for fused
kernels), and the hardware file records which. Runs stored before ``steps.csv`` recorded the
padded pairs get them from a checked replay of their scheduling (:mod:`experiments.calibration.replay`).

The datasheet-like ``--peak-tflops`` / ``--bandwidth-tbps`` only set the units of the terms (the
fitted multipliers absorb them); their defaults are this project's 2-core CPU probe in float32
(README: ~150 GFLOP/s matmul peak, ~25 GB/s streaming).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from hydra.utils import get_class
from omegaconf import OmegaConf

from engine.config import CONF_DIR
from engine.step_shape import StepShape
from experiments.calibration.replay import recovered_shapes
from experiments.calibration.suite import SUITE_FILE, load_plan, run_plan, suite_dir
from experiments.results.safe_files import write_text_file
from simulator.cost_model import CostModel, Fit, fit_coefficients
from simulator.feature_ranges import covered_ranges, ranges_yaml
from simulator.hardware import Hardware
from simulator.model_shapes import hf_config_of, model_config_for_costs

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "conf" / "hardware"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
AUTO_ATTENTION = OmegaConf.load(CONF_DIR / "attention" / "auto.yaml")["_target_"]
MIN_KEPT_SHARE = 0.75  # a fit that must set aside more steps than this share as disturbed is refused
DISTURBED_RATIO = 1.5  # steps measured over this x their prediction are set aside (see fit_coefficients)
NEEDED_COLUMNS = ("duration_s", "start_time", "end_time", "num_seqs", "num_prefill_tokens", "num_decode_tokens",
                  "num_wasted_slots", "num_sampled", "context_tokens", "prefill_attention_pairs")


def step_shapes(steps: pd.DataFrame) -> list[StepShape]:
    """The shape of every recorded step (the columns ``engine.step_shape.StepShape`` wrote; padded
    pairs 0 where not recorded: only a padded-pairs calibration reads them, and it replays them;
    shared context 0 where not recorded: :func:`load_run` allows that only without a prefix cache)."""
    rows = steps.num_prefill_tokens + steps.num_decode_tokens + steps.num_wasted_slots
    zeros = [0] * len(steps)
    padded = steps.padded_attention_pairs if "padded_attention_pairs" in steps.columns else zeros
    shared = steps.shared_context_tokens if "shared_context_tokens" in steps.columns else zeros
    return [
        StepShape(num_seqs=int(s), num_rows=int(r), num_decode_tokens=int(d), num_wasted_slots=int(w),
                  num_sampled=int(n), context_tokens=int(c), prefill_attention_pairs=int(a),
                  padded_attention_pairs=int(p), shared_context_tokens=int(h))
        for s, r, d, w, n, c, a, p, h in zip(steps.num_seqs, rows, steps.num_decode_tokens, steps.num_wasted_slots,
                                             steps.num_sampled, steps.context_tokens, steps.prefill_attention_pairs,
                                             padded, shared)
    ]


def between_steps_s(steps: pd.DataFrame) -> float:
    """Median time from one step's end to the next one's start: the driver's own work per step,
    which a virtual clock must pass too. Idle waits for arrivals are the long tail the median ignores."""
    gaps = (steps.start_time.to_numpy()[1:] - steps.end_time.to_numpy()[:-1])
    return float(np.median(gaps)) if gaps.size else 0.0


def load_run(run_dir: Path) -> tuple[dict, pd.DataFrame]:
    """The run's resolved config (with ``_backend``: what the run's summary.json says it built) and its steps."""
    config_file, steps_file = run_dir / "config.yaml", run_dir / "steps.csv"
    if not config_file.is_file() or not steps_file.is_file():
        raise ValueError(f"{run_dir} is not a run folder: it needs config.yaml and steps.csv")
    cfg = OmegaConf.to_container(OmegaConf.load(config_file), resolve=True)
    cfg["_backend"] = built_backend(run_dir)
    steps = pd.read_csv(steps_file)
    missing = [c for c in NEEDED_COLUMNS if c not in steps.columns or steps[c].isna().any()]
    if missing:
        raise ValueError(f"{steps_file} lacks {missing}: rerun it with servelab's engine (HF peers and older runs "
                         "do not record the step shape)")
    if "PrefixCache" in str((cfg.get("cache") or {}).get("_target_")) and "shared_context_tokens" not in steps.columns:
        raise ValueError(f"{steps_file} ran the prefix cache but lacks shared_context_tokens (recorded since "
                         "2026-11-30 17:11 UTC): rerun it")
    if attention_pairs(cfg) == "padded" and ("padded_attention_pairs" not in steps.columns
                                             or steps.padded_attention_pairs.isna().any()):
        steps = recovered_shapes(run_dir, steps)  # a run stored before the column: checked replay
    return cfg, steps


def built_backend(run_dir: Path) -> dict:
    """What the run's ``summary.json`` says the engine built: ``attention_backend`` (the backend
    ``attention=auto`` chose) and the linears' :data:`ENGINE_RECORDS`; ``None`` where a run
    predates the record."""
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    environment = summary.get("environment") or {}
    return {"attention_backend": (summary.get("run") or {}).get("attention_backend"),
            **{key: environment.get(key) for key in ENGINE_RECORDS}}


def attention_pairs(cfg: dict) -> str:
    """Which pairs the run's attention backend computes (``"padded"`` or ``"causal"``): the backend
    the run built (its summary's ``attention_backend``), else its config's ``_target_``."""
    backend = (cfg.get("_backend") or {}).get("attention_backend")
    if backend is not None:
        target = OmegaConf.load(CONF_DIR / "attention" / f"{backend}.yaml")["_target_"]
    else:
        target = (cfg.get("attention") or {}).get("_target_")
        if target == AUTO_ATTENTION:
            raise ValueError("the run's config says attention=auto and it has no summary.json naming the backend "
                             "that was built (run.attention_backend): its attention pairs are unknown")
    try:
        return get_class(target).attention_pairs
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"attention backend {target!r} of the run is unknown or does not say which pairs it "
                         f"computes ({error})") from error


#: how the run's engine ran its linears, per run: summary.json key -> (Hardware field, option, value for old runs)
ENGINE_RECORDS = {
    "skinny_gemm_max_rows": ("small_batch_rows", "--small-batch-rows",
                             "24 for servelab before 2026-11-30 15:00 UTC, 128 after"),
    "skinny_gemm_tile_rows": ("small_batch_tile_rows", "--small-batch-tile-rows",
                              "8 for the AVX-512 build of 2026-11-30, 4 with AVX2"),
    "onednn_row_buckets": ("large_batch_row_buckets", "--large-batch-row-buckets",
                           "4 for prepacked runs from 2026-11-30 15:21 UTC, 0 before or without prepack"),
}


def run_engine_record(run_dir: Path, cfg: dict, key: str, override: int | None) -> int:
    """What the run's engine recorded under ``key`` (:data:`ENGINE_RECORDS`), or ``override`` where given."""
    if override is not None:
        return override
    recorded = (cfg.get("_backend") or {}).get(key)
    if recorded is None:
        _, option, hint = ENGINE_RECORDS[key]
        raise ValueError(f"{run_dir}/summary.json does not record the engine's {key} (a run made before it was "
                         f"recorded): pass {option} ({hint})")
    return int(recorded)


def calibrate(run_dirs: Sequence[Path], peak_tflops: float, bandwidth_tbps: float,
              overrides: dict[str, int | None] | None = None) -> tuple[Fit, dict, dict]:
    """Fit on all steps of ``run_dirs``; returns the fit, the model spec and what was fitted on
    (with ``feature_ranges``: the range of every cost-model feature over the steps the fit kept).

    ``overrides``: by :data:`ENGINE_RECORDS` key, how the linears ran (the few-row GEMM's limit and
    register tile, the oneDNN row buckets); missing or ``None`` takes what each run recorded (all
    runs must agree), a number overrides it (runs made before it was recorded)."""
    overrides = overrides or {}
    configs, pairs, limits, shapes, terms, seconds = [], [], [], [], [], []
    for run_dir in run_dirs:
        cfg, steps = load_run(Path(run_dir))
        configs.append(cfg)
        pairs.append(attention_pairs(cfg))
        limits.append({ENGINE_RECORDS[key][0]: run_engine_record(Path(run_dir), cfg, key, overrides.get(key))
                       for key in ENGINE_RECORDS})
        if cfg["model"].get("hf_config") != configs[0]["model"].get("hf_config"):
            raise ValueError(f"{run_dir} ran model {cfg['model'].get('name')!r}, not {configs[0]['model'].get('name')!r}: "
                             "calibrate one model at a time")
        if pairs[-1] != pairs[0]:
            raise ValueError(f"{run_dir} ran a {pairs[-1]}-pairs attention backend, the first run a "
                             f"{pairs[0]} one: calibrate one kind of attention kernel at a time")
        if limits[-1] != limits[0]:
            raise ValueError(f"{run_dir} ran its linears with {limits[-1]}, the first run with {limits[0]}: "
                             "calibrate runs of one engine build at a time")
        units = Hardware(name="units", peak_tflops=peak_tflops, bandwidth_tbps=bandwidth_tbps,
                         dtype_bytes=DTYPE_BYTES.get(cfg.get("dtype"), 4), attention_pairs=pairs[-1], **limits[-1])
        model = CostModel(units, model_config_for_costs(hf_config_of(cfg["model"])[0]))
        run_shapes = step_shapes(steps)
        shapes += run_shapes
        terms += [model.terms(shape) for shape in run_shapes]
        seconds += (steps.duration_s + between_steps_s(steps)).tolist()
    first = configs[0]
    attention = first["_backend"]["attention_backend"] or (first.get("attention") or {}).get("_target_")
    shared_kv_seen = any(t.shared_kv_s > 0 for t in terms)
    about = {"model": first["model"].get("name"), "dtype": first.get("dtype"),
             "dtype_bytes": DTYPE_BYTES.get(first.get("dtype"), 4), "device": first.get("device"),
             "attention": attention, "attention_pairs": pairs[0],
             **limits[0], "shared_kv_seen": shared_kv_seen,
             "engine": first.get("engine")}
    fit = fit_coefficients(terms, seconds, DISTURBED_RATIO)
    about["feature_ranges"] = covered_ranges([s for s, kept in zip(shapes, fit.kept) if kept], pairs[0])
    return fit, first["model"], about


def hardware_yaml(name: str, fit: Fit, about: dict, run_dirs: Sequence[Path], peak_tflops: float,
                  bandwidth_tbps: float, when: str, note: str = "", suite: bool = False) -> str:
    c = fit.coefficients
    runs = ", ".join(str(p) for p in run_dirs)
    engine_options = {k: v for k, v in (about["engine"] or {}).items() if not k.startswith("_")}
    shared_kv = (f"{c['shared_kv_time_scale']:.6g}   # fitted: x (bytes of KV blocks another sequence of the step reads "
                 "too / bandwidth_tbps)" if about["shared_kv_seen"] else
                 "null   # not fitted: no calibration step shared a KV block (null: priced as kv_time_scale)")
    inputs = "--suite" if suite else " ".join(str(p) for p in run_dirs)
    how = (f"python -m experiments.calibration.calibrate {inputs} --name {name} ({when}); "
           f"{fit.num_kept} of {fit.num_steps} steps kept (the rest disturbed, > {DISTURBED_RATIO}x the fit), "
           f"R^2 {fit.r_squared:.3f}, median |relative error| {fit.median_abs_rel_error:.1%}"
           + (f"; {note}" if note else ""))
    return f"""# Calibrated on a real machine by experiments/calibration/calibrate.py: coefficients fitted (non-negative
# least squares) to the step durations of {runs}.
# Valid for model {about['model']} ({about['dtype']}) with attention {about['attention']} and engine
# options {engine_options}: the step overhead and weight terms hold that model's weight read. Formula: docs/simulator.md.
_target_: simulator.hardware.Hardware
name: {name}
peak_tflops: {peak_tflops}          # units only: FLOP term = FLOPs / this (the fitted multiplier absorbs it)
bandwidth_tbps: {bandwidth_tbps}       # units only: byte terms = bytes / this
memory_gb: null             # unknown: the KV budget comes from cache.capacity_tokens
tensor_parallel: 1          # one device (this machine)
dtype_bytes: {about['dtype_bytes']}               # bytes per weight / K/V element of the calibration runs ({about['dtype']})
step_overhead_s: {c['step_overhead_s']:.6g}   # fitted: fixed per step, includes the weight read and the driver's gap
seq_overhead_s: {c['seq_overhead_s']:.6g}   # fitted: per scheduled sequence
linear_time_scale: {c['linear_time_scale']:.6g}   # fitted: x (linear FLOPs / peak_tflops)
small_batch_rows: {about['small_batch_rows']}        # steps of <= this many rows take the few-row GEMM path (the runs' skinny_gemm_max_rows)
small_batch_time_scale: {c['small_batch_time_scale']:.6g}   # fitted: extra x (linear FLOPs / peak_tflops) on those steps
small_batch_tile_rows: {about['small_batch_tile_rows']}        # rows of the few-row GEMM's full register tile (the runs' skinny_gemm_tile_rows; 0: none)
tile_tail_time_scale: {c['tile_tail_time_scale']:.6g}   # fitted: x (linear FLOPs / peak_tflops) of the rows outside full tiles, in pairs
large_batch_row_buckets: {about['large_batch_row_buckets']}        # larger GEMMs compute rows padded to this many buckets per octave (the runs' onednn_row_buckets; 0: none)
weight_time_scale: {c['weight_time_scale']:.6g}   # fitted: x (weight bytes / bandwidth_tbps) on weight-bound steps (0: none seen; step_overhead_s holds the read)
kv_time_scale: {c['kv_time_scale']:.6g}   # fitted: x (KV bytes read / bandwidth_tbps)
shared_kv_time_scale: {shared_kv}
attention_time_scale: {c['attention_time_scale']:.6g}   # fitted: x (attention FLOPs / peak_tflops)
attention_pairs: {about['attention_pairs']}     # pairs the calibrated attention backend computes (padded: gather + dense SDPA)
calibrated: true            # fitted on a real machine (summaries say "simulated, calibrated")
calibrated_model: {about['model']}    # the model the fit is valid for
calibration: "{how}"        # how this file was made
{ranges_yaml(about['feature_ranges'])}
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="*", type=Path, help="run folders with config.yaml and steps.csv")
    parser.add_argument("--suite", action="store_true",
                        help=f"run the calibration suite ({SUITE_FILE.relative_to(SUITE_FILE.parents[2])}) with the "
                             "real engine first and fit on its runs (instead of run_dirs)")
    parser.add_argument("--name", required=True, help="writes conf/hardware/<name>.yaml")
    parser.add_argument("--peak-tflops", type=float, default=0.15, help="units of the FLOP terms")
    parser.add_argument("--bandwidth-tbps", type=float, default=0.025, help="units of the byte terms")
    parser.add_argument("--small-batch-rows", type=int, default=None,
                        help="steps of at most this many rows are in the small-batch GEMM regime (0: none); "
                             "default: the skinny_gemm_max_rows each run's summary.json records")
    parser.add_argument("--small-batch-tile-rows", type=int, default=None,
                        help="rows of the few-row GEMM's full register tile (0: no tile term); "
                             "default: the skinny_gemm_tile_rows each run's summary.json records")
    parser.add_argument("--large-batch-row-buckets", type=int, default=None,
                        help="larger GEMMs pad their rows to this many buckets per octave (0: none); "
                             "default: the onednn_row_buckets each run's summary.json records")
    parser.add_argument("--min-steps", type=int, default=30, help="fewer steps: refuse to fit")
    parser.add_argument("--min-r2", type=float, default=0.9, help="a fit with lower R^2: refuse to write")
    parser.add_argument("--out-dir", type=Path, default=HARDWARE_DIR, help="where hardware files live")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing file of that name")
    parser.add_argument("--note", default="", help="how the runs were made, kept in the file (e.g. OMP_NUM_THREADS=1)")
    args = parser.parse_args(argv)
    if args.suite == bool(args.run_dirs):
        parser.error("give run folders or --suite, not both or neither")
    target = args.out_dir / f"{args.name}.yaml"
    if target.exists() and not args.overwrite:
        print(f"{target} exists; pick another --name or pass --overwrite", file=sys.stderr)
        return 2
    try:
        if args.suite:
            plan = load_plan()
            print(f"calibration suite: {len(plan.runs)} real runs of {plan.model} into {suite_dir(args.name)}")
            args.run_dirs = run_plan(plan, suite_dir(args.name))
            args.note = "; ".join(filter(None, [f"the calibration suite ({SUITE_FILE.name}), "
                                                f"{' '.join(f'{k}={v}' for k, v in plan.env.items())}", args.note]))
        fit, _, about = calibrate(args.run_dirs, args.peak_tflops, args.bandwidth_tbps, {
            "skinny_gemm_max_rows": args.small_batch_rows, "skinny_gemm_tile_rows": args.small_batch_tile_rows,
            "onednn_row_buckets": args.large_batch_row_buckets})
    except ValueError as error:
        print(f"calibration failed: {error}", file=sys.stderr)
        return 2
    print(f"fit on {fit.num_kept} of {fit.num_steps} steps ({fit.num_steps - fit.num_kept} set aside as disturbed): "
          f"R^2 {fit.r_squared:.3f}, median |relative error| {fit.median_abs_rel_error:.1%}, "
          f"coefficients {fit.coefficients}")
    if fit.num_kept < MIN_KEPT_SHARE * fit.num_steps:
        print(f"only {fit.num_kept} of {fit.num_steps} steps fit the model within {DISTURBED_RATIO}x: the machine was "
              "too busy, or the model does not describe it; nothing written", file=sys.stderr)
        return 1
    if fit.num_kept < args.min_steps:
        print(f"too few steps ({fit.num_kept} usable < --min-steps {args.min_steps}): nothing written; "
              "calibrate on a longer run (e.g. workload.concurrency=16)", file=sys.stderr)
        return 1
    if fit.r_squared < args.min_r2:
        print(f"the fit explains too little (R^2 {fit.r_squared:.3f} < --min-r2 {args.min_r2}): nothing written; "
              "the runs are too noisy or too uniform (calibrate on a run with prefills and decodes of varied batch)",
              file=sys.stderr)
        return 1
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # crash-safe; replaces an existing file only with --overwrite (checked above)
    write_text_file(hardware_yaml(args.name, fit, about, args.run_dirs, args.peak_tflops, args.bandwidth_tbps, when,
                                  args.note.replace('"', "'"), args.suite),
                    target, replace=args.overwrite)
    print(f"wrote {target}: use it as hardware={args.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
