"""Load curves: how latency, goodput and per-user speed change as a sweep's load grows.

A sweep that varies the offered load (users in flight, a request rate) traces one curve per
strategy. The x axis is the *achieved* request rate (``request_throughput``: finished requests per
second), not the configured one: a saturated server finishes fewer requests than it is offered,
and the curve then bends up (latency) or flattens (goodput) where the server gives out.

* :func:`latency_vs_rate_figure`: TTFT, ITL and E2E, p50 (solid) and p99 (dashed), vs request/s.
* :func:`goodput_vs_rate_figure`: goodput (requests/s meeting every SLO) vs request/s; the dotted
  diagonal is "every request met its SLOs".
* :func:`pareto_figure`: output tok/s per user (``1 / mean TPOT``: the decode speed one user sees)
  against total output tok/s, every run a point, the Pareto front (runs no other run beats on
  both axes) joined by a line: the trade-off ``vllm bench sweep plot_pareto`` draws.

Each returns a matplotlib figure, or ``None`` when the sweep has too few successful runs with
the numbers (the page then says so). Runs are labelled by the caller (``label(row)``: the
strategy, i.e. what varies besides the load and the repeat number).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

#: report columns that set the offered load; a curve runs along them, so they are left out of its label
LOAD_COLUMNS = ("concurrency", "rate", "override:workload.concurrency", "override:workload.num_users",
                "override:driver.max_concurrency", "override:workload.rate")
#: report columns that only repeat a measurement: a strategy's repeats are points of one curve
REPEAT_COLUMNS = ("repeat", "override:repeat")
RATE = "request_throughput"
LATENCIES = [("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")]


def _ok_runs(frame: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """Successful runs that have every one of ``columns``."""
    if "status" not in frame or any(c not in frame for c in columns):
        return frame.iloc[0:0]
    return frame[frame["status"] == "ok"].dropna(subset=list(columns))


def _groups(runs: pd.DataFrame, label: Callable[[pd.Series], str]) -> list[tuple[str, pd.DataFrame]]:
    names = runs.apply(label, axis=1) if len(runs) else pd.Series(dtype=str)
    return [(str(name), part.sort_values(RATE)) for name, part in runs.groupby(names, sort=True)]


def latency_vs_rate_figure(frame: pd.DataFrame, label: Callable[[pd.Series], str]) -> plt.Figure | None:
    """TTFT / ITL / E2E p50 and p99 vs achieved request/s, one line per strategy; ``None`` under two runs."""
    shown = [(name, key) for name, key in LATENCIES if f"{key}_p50" in frame and f"{key}_p99" in frame]
    runs = _ok_runs(frame, [RATE])
    if len(runs) < 2 or not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 3.8), squeeze=False)
    for ax, (name, key) in zip(axes[0], shown):
        for group, part in _groups(runs, label):
            line = ax.plot(part[RATE], part[f"{key}_p50"], marker="o", label=group)[0]
            ax.plot(part[RATE], part[f"{key}_p99"], marker="x", linestyle="--", color=line.get_color())
        ax.set(xlabel="achieved request/s", ylabel=f"{name} (s)", title=f"{name} p50 (solid) / p99 (dashed)")
    axes[0][-1].legend(fontsize=6)  # the same lines in every panel: one legend
    return fig


def goodput_vs_rate_figure(frame: pd.DataFrame, label: Callable[[pd.Series], str]) -> plt.Figure | None:
    """Goodput vs achieved request/s, one line per strategy; ``None`` under two runs with a goodput."""
    runs = _ok_runs(frame, [RATE, "goodput"])
    if len(runs) < 2:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for group, part in _groups(runs, label):
        ax.plot(part[RATE], part["goodput"], marker="o", label=group)
    top = float(runs[RATE].max())
    ax.plot([0, top], [0, top], linestyle=":", color="grey", label="every request meets its SLOs")
    ax.set(xlabel="achieved request/s", ylabel="goodput (request/s meeting the SLOs)", title="Goodput vs request rate")
    ax.legend(fontsize=7)
    return fig


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats or equals on both coordinates (higher is better on both),
    sorted by the first coordinate."""
    front, best_y = [], float("-inf")
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if y > best_y:
            front.append((x, y))
            best_y = y
    return sorted(front)


def pareto_figure(frame: pd.DataFrame, label: Callable[[pd.Series], str]) -> plt.Figure | None:
    """Output tok/s per user vs total output tok/s for every successful run, the Pareto front drawn;
    ``None`` under two runs with both numbers."""
    runs = _ok_runs(frame, ["output_throughput", "tpot_s_mean"])
    runs = runs[runs["tpot_s_mean"] > 0].assign(per_user=lambda f: 1.0 / f["tpot_s_mean"])
    if len(runs) < 2:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for group, part in _groups(runs, label):
        ax.scatter(part["output_throughput"], part["per_user"], label=group)
        if "concurrency" in part:
            for _, row in part.dropna(subset=["concurrency"]).iterrows():
                ax.annotate(f"c={row['concurrency']:g}", (row["output_throughput"], row["per_user"]), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
    front = pareto_front(list(zip(runs["output_throughput"], runs["per_user"])))
    ax.plot([x for x, _ in front], [y for _, y in front], color="black", linewidth=1, label="Pareto front")
    ax.set(xlabel="total output tok/s", ylabel="output tok/s per user (1 / mean TPOT)",
           title="Per-user speed vs total throughput")
    ax.legend(fontsize=7)
    return fig
