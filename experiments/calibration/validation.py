"""Simulator validation: the real engine and the calibrated simulator on identical requests.

    python run.py +experiment=simulator_validation          # the sweep, then this comparison
    python -m experiments.calibration.validation results/sweeps/<time>  # the comparison again, on a finished sweep
    python -m experiments.calibration.validation OUT --real-from results/sweeps/<time> --hardware NAME
                                   # re-simulate stored real runs on another calibration, no real engine

The sweep runs every held-out configuration (``conf/validation_case/``: scheduler x cache x
workload x concurrency, none of them the calibration run's) twice, ``engine=servelab`` then
``engine=simulated``, with the same seeded workload. This module pairs the two jobs of each
case and writes, into the sweep folder:

* ``validation.csv``: configuration, metric, real, simulated, relative error
  ((simulated - real) / real; 0 when both are 0);
* ``validation.md``: that table plus the median |relative error| per metric against the targets;
* ``validation.png``: relative error per metric and configuration.

``validation.md`` also says, per case, how far the simulated run lay outside the calibration's
ranges (``simulation.extrapolation`` of its summary: :mod:`simulator.extrapolation`).

``--real-from`` re-simulates a finished sweep's real runs instead of running the engine again:
each real job is copied unchanged into ``OUT/real/<job>``, and the simulator runs the same
configuration (the job's own Hydra overrides, with ``engine=simulated hardware=NAME``) into
``OUT/simulated/<job>``; the comparison is then written into ``OUT``. A change to the cost model
or a new calibration is checked against the very same real measurements, in seconds. Given several
``--hardware`` names, each is simulated into ``OUT/<name>/`` and ``OUT/calibrations.md`` sets their
median errors side by side, with how many cases each flagged as extrapolating: what a calibration
of one's own buys against the calibration suite, on the same real runs. The sweep's callback does
the same for its ``compare_hardware`` (``+experiment=simulator_validation_regimes``).
"""
from __future__ import annotations

import argparse
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from hydra.experimental.callback import Callback  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from engine.config import CONF_DIR  # noqa: E402
from experiments.harness.job import execute  # noqa: E402
from experiments.results.plots import save_figure  # noqa: E402
from experiments.results.report import collect, job_dirs, markdown_table, read_summary  # noqa: E402
from experiments.results.files import write_csv, write_text_file  # noqa: E402

CASE_COLUMN = "override:validation_case"
#: metric key in summary.json -> (label, target median |relative error| or None)
METRICS: dict[str, tuple[str, float | None]] = {
    "output_throughput": ("output tok/s", 0.05),
    "tpot_s_p50": ("TPOT p50", 0.05),
    "ttft_s_p50": ("TTFT p50", 0.10),
    "ttft_s_p99": ("TTFT p99", 0.15),
    "e2e_s_p50": ("E2E p50", None),
    "preemptions": ("preemptions", None),
    "prefix_hit_tokens": ("prefix-hit tokens", None),
}


def relative_error(real: float, simulated: float) -> float:
    if real == 0:
        return 0.0 if simulated == 0 else math.inf
    return (simulated - real) / real


def comparison(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (configuration, metric) from a sweep's report frame.

    A case run more than once (``+repeat=0,1,2``: the same seeded requests each time) is
    compared on the median of its real runs, which cuts the noise of a single run on a shared
    machine; ``real_spread`` is (max - min) / median of those runs (0 for one run). The simulator
    is deterministic, so its runs of a case agree and their median is any of them."""
    if CASE_COLUMN not in frame:
        raise ValueError("not a simulator_validation sweep: no validation_case override in its jobs")
    rows: list[dict[str, Any]] = []
    for case, jobs in frame.groupby(CASE_COLUMN, sort=False):
        ok = jobs[jobs.get("status") == "ok"] if "status" in jobs else jobs
        real, simulated = ok[ok.engine == "servelab"], ok[ok.engine == "simulated"]
        if real.empty or simulated.empty or len(ok) < len(jobs):
            rows.append({"configuration": case, "metric": "status", "real": None, "simulated": None,
                         "relative_error": None, "real_spread": None, "note": "a job failed: no comparison"})
            continue
        for key, (label, _) in METRICS.items():
            real_values = real[key].fillna(0.0).astype(float) if key in real else pd.Series([0.0])
            real_value = float(real_values.median())
            sim_value = float(simulated[key].fillna(0.0).astype(float).median()) if key in simulated else 0.0
            spread = float(real_values.max() - real_values.min()) / real_value if real_value else 0.0
            rows.append({"configuration": case, "metric": label, "real": real_value, "simulated": sim_value,
                         "relative_error": relative_error(real_value, sim_value), "real_spread": spread,
                         "note": f"median of {len(real_values)} real runs" if len(real_values) > 1 else ""})
    return pd.DataFrame(rows)


def medians(table: pd.DataFrame) -> pd.DataFrame:
    """Median |relative error| per metric over configurations, with the target and whether it is met."""
    rows = []
    for key, (label, target) in METRICS.items():
        errors = table.loc[table.metric == label, "relative_error"].dropna().abs()
        median = float(np.median(errors)) if len(errors) else None
        rows.append({"metric": label, "median_abs_relative_error": median, "target": target,
                     "met": None if target is None or median is None else median <= target})
    return pd.DataFrame(rows)


def plot(table: pd.DataFrame, path: Path) -> Path:
    ok = table.dropna(subset=["relative_error"])
    ok = ok[np.isfinite(ok.relative_error)]
    labels = [label for label, _ in METRICS.values()]
    cases = list(dict.fromkeys(ok.configuration))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(len(cases), 1)
    for index, case in enumerate(cases):
        part = ok[ok.configuration == case].set_index("metric").reindex(labels)
        ax.bar(np.arange(len(labels)) + index * width, 100 * part.relative_error.fillna(0), width, label=case)
    for _, (label, target) in METRICS.items():
        if target is not None:
            x = labels.index(label)
            ax.hlines([-100 * target, 100 * target], x - 0.1, x + 0.9, colors="k", linestyles="dotted")
    ax.axhline(0, color="k", linewidth=0.5)
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, fontsize=8)
    ax.set(ylabel="simulated vs real (%)", title="Simulator vs real engine, held-out configurations (dotted: targets)")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def worst_feature(features: dict[str, dict]) -> str | None:
    """The feature furthest beyond its range and by how much (``None``: every step inside)."""
    beyond = {name: math.inf if f["max_ratio"] is None else f["max_ratio"]
              for name, f in features.items() if f["steps_outside"]}
    if not beyond:
        return None
    name = max(beyond, key=beyond.get)
    return f"{name} {'never seen' if math.isinf(beyond[name]) else f'{beyond[name]:.3g}x'}"


def extrapolation(root: Path, frame: pd.DataFrame) -> pd.DataFrame:
    """Per case, how far its simulated run(s) lay outside the calibration's ranges (the first
    simulated job's ``simulation.extrapolation``; the simulator is deterministic)."""
    rows = []
    for case, jobs in frame.groupby(CASE_COLUMN, sort=False):
        simulated = jobs[jobs.engine == "simulated"] if "engine" in jobs else jobs.iloc[:0]
        report = None
        for job in simulated.job:
            summary_file = root / job / "summary.json"
            if summary_file.is_file():
                report = (read_summary(summary_file).get("simulation") or {}).get("extrapolation")
                break
        if not report:
            rows.append({"configuration": case, "status": "not recorded", "share_outside": None, "worst": None})
            continue
        rows.append({"configuration": case, "status": report["status"], "share_outside": report.get("share_outside"),
                     "worst": worst_feature(report.get("features") or {})})
    return pd.DataFrame(rows)


def write_validation(root: Path) -> list[Path]:
    frame = collect(root)
    table = comparison(frame)
    summary = medians(table)
    outside = extrapolation(root, frame)
    csv = write_csv(table.drop(columns="note"), root / "validation.csv")
    md = write_text_file("\n".join([
        f"# Simulator validation: {root}", "",
        "Median |relative error| over the held-out configurations:", "",
        markdown_table(summary, list(summary.columns)), "",
        "Simulated steps outside the calibration's ranges (docs/simulator.md):", "",
        markdown_table(outside, list(outside.columns)), "", "Every row:", "",
        markdown_table(table, ["configuration", "metric", "real", "simulated", "relative_error", "real_spread", "note"]), "",
    ]), root / "validation.md")
    return [csv, md, plot(table, root / "validation.png")]


def simulated_overrides(overrides: Sequence[str], hardware: str) -> list[str]:
    """A real job's Hydra overrides with the engine swapped for the simulator on ``hardware``."""
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in ("engine", "hardware")]
    return [*kept, "engine=simulated", f"hardware={hardware}"]


def resimulate(real_from: Path, out: Path, hardware: str) -> list[Path]:
    """Copy ``real_from``'s real jobs into ``out/real/``, simulate each into ``out/simulated/``, compare."""
    real_jobs = [job for job in job_dirs(real_from)
                 if (job / "summary.json").is_file() and read_summary(job / "summary.json")["run"].get("engine") == "servelab"]
    if not real_jobs:
        raise ValueError(f"no real (engine=servelab) jobs with a summary.json under {real_from}")
    for job in real_jobs:
        name = str(job.relative_to(real_from))
        shutil.copytree(job, out / "real" / name)
        overrides = simulated_overrides(yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()), hardware)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        choices = dict(cfg.hydra.runtime.choices)
        OmegaConf.set_struct(cfg, False)
        del cfg["hydra"]
        target = out / "simulated" / name
        (target / ".hydra").mkdir(parents=True)
        (target / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        outcome = execute(cfg, target, choices=choices, overrides=overrides)
        if outcome.failed:
            print(f"simulating {name} failed: {outcome.summary['error']}")
    return write_validation(out)


#: the metrics calibrations.md sets side by side
HEADLINE = ("output tok/s", "TPOT p50", "TTFT p50", "TTFT p99")


def compare_calibrations(roots: dict[str, Path], out: Path) -> Path:
    """``out/calibrations.md``: per calibration (name -> a folder with its real and simulated jobs),
    the median |relative error| of the headline metrics and the cases it flagged as extrapolating,
    then every case's errors and extrapolation under each calibration."""
    totals, cases = [], []
    for name, root in roots.items():
        frame = collect(root)
        table, outside = comparison(frame), extrapolation(root, frame).set_index("configuration")
        errors = medians(table).set_index("metric").median_abs_relative_error
        totals.append({"calibration": name, **{label: errors[label] for label in HEADLINE},
                       "cases extrapolating": f"{int((outside.status == 'extrapolates').sum())} of {len(outside)}"})
        for case, rows in table.groupby("configuration", sort=False):
            by_metric = rows.set_index("metric").relative_error
            cases.append({"configuration": case, "calibration": name,
                          **{label: by_metric.get(label) for label in HEADLINE},
                          "extrapolation": outside.status.get(case), "share outside": outside.share_outside.get(case),
                          "worst feature": outside.worst.get(case)})
    totals_frame, cases_frame = pd.DataFrame(totals), pd.DataFrame(cases).sort_values(["configuration", "calibration"],
                                                                                      kind="stable")
    return write_text_file("\n".join([
        f"# Simulator validation by calibration: {', '.join(roots)}", "",
        "Median |relative error| over the same held-out cases and real runs; cases whose simulated run "
        "left the calibration's ranges too far (simulator/extrapolation.py):", "",
        markdown_table(totals_frame, list(totals_frame.columns)), "",
        "Relative error (simulated - real) / real per case:", "",
        markdown_table(cases_frame, list(cases_frame.columns)), "",
    ]), out / "calibrations.md")


def sweep_hardware(root: Path) -> str:
    """The hardware the sweep's simulated jobs ran on."""
    frame = collect(root)
    names = frame.loc[frame.engine == "simulated", "hardware"].dropna().unique() if "hardware" in frame else []
    if len(names) != 1:
        raise ValueError(f"{root}: expected the simulated jobs to run on one hardware, got {list(names)}")
    return str(names[0])


class ValidationCallback(Callback):
    """Hydra callback: the comparison when the validation sweep ends; with ``compare_hardware``,
    the sweep's real runs re-simulated on each of those calibrations (``<sweep>-on-<name>/``) and
    ``calibrations.md`` comparing them with the sweep's own."""

    def __init__(self, compare_hardware: Sequence[str] = ()) -> None:
        self.compare_hardware = list(compare_hardware)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        root = Path(config.hydra.sweep.dir)
        written = write_validation(root)
        print(written[1].read_text())
        if self.compare_hardware:
            GlobalHydra.instance().clear()  # the sweep is over: resimulate composes each job's config itself
            roots = {sweep_hardware(root): root}
            for name in self.compare_hardware:
                roots[name] = root.with_name(f"{root.name}-on-{name}")
                resimulate(root, roots[name], name)
            written.append(compare_calibrations(roots, root))
            print(written[-1].read_text())
        print("\n".join(str(p) for p in written))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a finished +experiment=simulator_validation sweep (with "
                        "--real-from: a new folder to write the re-simulation into)")
    parser.add_argument("--real-from", type=Path, help="re-simulate this finished sweep's real jobs into sweep_dir")
    parser.add_argument("--hardware", nargs="+", help="with --real-from: the calibration(s) to simulate on "
                        "(conf/hardware/<name>); several: each into sweep_dir/<name>/, compared in calibrations.md")
    args = parser.parse_args(argv)
    if args.real_from is None:
        report = write_validation(args.sweep_dir)[1]
    elif args.hardware is None or args.sweep_dir.exists():
        parser.error("--real-from needs --hardware and a sweep_dir that does not exist yet")
    elif len(args.hardware) == 1:
        report = resimulate(args.real_from, args.sweep_dir, args.hardware[0])[1]
    else:
        roots = {name: args.sweep_dir / name for name in args.hardware}
        for name, root in roots.items():
            resimulate(args.real_from, root, name)
        report = compare_calibrations(roots, args.sweep_dir)
    print(report.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
