"""PNG plots (matplotlib, Agg backend), drawn from result tables already read.

Per run (:func:`plot_run`, written next to the run's CSV files): KV memory, batch shape, TTFT
distribution. Per sweep (:mod:`experiments.results.report` reads the runs and labels them): a
metric against concurrency or block size with one line per strategy (:func:`plot_vs`), and one
curve per run of the TTFT CDF (:func:`plot_ttft_cdf`) and of KV usage over time
(:func:`plot_kv_over_time`). A plot whose data is missing is not drawn (``None``).

Each sweep plot is a figure builder (``*_figure``, returning the matplotlib figure or ``None``)
and a ``plot_*`` wrapper that saves it as a file; :mod:`experiments.results.html_report` embeds
the same figures in ``report.html`` through :func:`figure_png`.
"""
from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.results.safe_files import write_file  # noqa: E402


def save_figure(fig: plt.Figure, path: Path) -> Path:
    """Save ``fig`` as PNG at ``path`` (or a suffixed name if it exists), crash-safely, and close it."""
    fig.tight_layout()
    try:
        return write_file(path, lambda partial: fig.savefig(partial, dpi=110))
    finally:
        plt.close(fig)


def figure_png(fig: plt.Figure) -> bytes:
    """``fig`` as PNG bytes (for a page that embeds its images), cropped to what it draws (legends
    beside the axes included), and close it."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    finally:
        plt.close(fig)
    return buffer.getvalue()


def _has(frame: pd.DataFrame, column: str) -> bool:
    return column in frame and frame[column].notna().any()


def plot_kv_usage(steps: pd.DataFrame, path: Path) -> Path | None:
    """KV tokens used / reserved / capacity at the end of each step."""
    if not _has(steps, "kv_used_tokens"):
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for column, label in (("kv_used_tokens", "used"), ("kv_reserved_tokens", "reserved"), ("kv_capacity_tokens", "capacity")):
        if _has(steps, column):
            ax.step(steps["end_time"], steps[column], where="post", label=label)
    ax.set(xlabel="time since run start (s)", ylabel="KV tokens", title="KV cache usage")
    ax.legend()
    return save_figure(fig, path)


def plot_batch(steps: pd.DataFrame, path: Path) -> Path | None:
    """Sequences per step and tokens per step (prefill / decode), plus wasted slots."""
    if not _has(steps, "num_seqs"):
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.step(steps["step"], steps["num_seqs"], where="post", label="sequences in batch")
    if _has(steps, "num_wasted_slots"):
        top.step(steps["step"], steps["num_wasted_slots"], where="post", label="wasted slots")
    top.set(ylabel="sequences")
    top.legend()
    bottom.bar(steps["step"], steps["num_prefill_tokens"].fillna(0), label="prefill tokens", width=1.0)
    bottom.bar(steps["step"], steps["num_decode_tokens"].fillna(0), bottom=steps["num_prefill_tokens"].fillna(0),
               label="decode tokens", width=1.0)
    bottom.set(xlabel="step", ylabel="tokens")
    bottom.legend()
    return save_figure(fig, path)


def plot_ttft(requests: pd.DataFrame, path: Path) -> Path | None:
    """TTFT histogram and empirical CDF."""
    if not _has(requests, "ttft_s"):
        return None
    values = np.sort(requests["ttft_s"].dropna().to_numpy())
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(8, 3.5))
    hist.hist(values, bins=min(30, max(5, len(values))))
    hist.set(xlabel="TTFT (s)", ylabel="requests", title="TTFT histogram")
    cdf.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
    cdf.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    return save_figure(fig, path)


def plot_run(requests: pd.DataFrame, steps: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Every per-run plot that has data; returns the written files."""
    written = [
        plot_kv_usage(steps, out_dir / "kv_usage.png"),
        plot_batch(steps, out_dir / "batch.png"),
        plot_ttft(requests, out_dir / "ttft.png"),
    ]
    return [p for p in written if p is not None]


def plot_vs(frame: pd.DataFrame, x: str, metrics: Sequence[tuple[str, str]], path: Path,
            label: Callable[[pd.Series], str]) -> Path | None:
    """One subplot per ``(metric, axis label)``, one line per strategy (``label`` of a run's report
    row), ``x`` on the axis; runs whose status is not ``ok`` are left out."""
    if x not in frame or any(metric not in frame for metric, _ in metrics):  # e.g. summaries of an older version
        return None
    ok = frame[frame["status"] == "ok"].dropna(subset=[x])
    if ok[x].nunique() < 2:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8), squeeze=False)
    for ax, (metric, axis_label) in zip(axes[0], metrics):
        for name, part in ok.groupby(ok.apply(label, axis=1)):
            part = part.sort_values(x)
            ax.plot(part[x], part[metric], marker="o", label=name)
        ax.set(xlabel=x, ylabel=axis_label)
        if x == "concurrency" or x == "block_size":
            ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def cdf_figure(runs: Iterable[tuple[str, pd.DataFrame]], column: str, xlabel: str, title: str) -> plt.Figure | None:
    """The empirical CDF of ``column`` for every ``(label, requests.csv table)`` in ``runs``; ``None`` when
    no run has a value of it."""
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = 0
    for label, requests in runs:
        values = np.sort(requests[column].dropna().to_numpy()) if column in requests else np.array([])
        if values.size:
            ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=label)
            drawn += 1
    return _label_if_drawn(fig, ax, drawn, xlabel=xlabel, ylabel="fraction of requests", title=title, ylim=(0, 1.02))


def plot_ttft_cdf(runs: Iterable[tuple[str, pd.DataFrame]], path: Path) -> Path | None:
    """The empirical TTFT CDF of every ``(label, requests.csv table)`` in ``runs``."""
    return _save_drawn(cdf_figure(runs, "ttft_s", "TTFT (s)", "TTFT CDF"), path)


def kv_over_time_figure(runs: Iterable[tuple[str, pd.DataFrame]]) -> plt.Figure | None:
    """KV tokens used (solid) and reserved (dashed) over time, for every ``(label, steps.csv table)`` in
    ``runs``; ``None`` when no run recorded KV usage (e.g. an HTTP peer)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = 0
    for label, steps in runs:
        if steps.empty or not _has(steps, "kv_used_tokens"):
            continue
        line = ax.step(steps["end_time"], steps["kv_used_tokens"], where="post", label=f"{label} used")[0]
        if _has(steps, "kv_reserved_tokens"):
            ax.step(steps["end_time"], steps["kv_reserved_tokens"], where="post", linestyle="--", color=line.get_color())
        drawn += 1
    return _label_if_drawn(fig, ax, drawn, xlabel="time since run start (s)", ylabel="KV tokens",
                           title="KV used (solid) / reserved (dashed)")


def plot_kv_over_time(runs: Iterable[tuple[str, pd.DataFrame]], path: Path) -> Path | None:
    """KV tokens used (solid) and reserved (dashed) over time, for every ``(label, steps.csv table)`` in ``runs``."""
    return _save_drawn(kv_over_time_figure(runs), path)


def _label_if_drawn(fig: plt.Figure, ax: plt.Axes, drawn: int, **axis: Any) -> plt.Figure | None:
    """Label ``ax`` (``axis``: ``Axes.set`` keywords) and return ``fig`` when it has ``drawn`` curves; else close it."""
    if not drawn:
        plt.close(fig)
        return None
    ax.set(**axis)
    ax.legend(fontsize=7)
    return fig


def _save_drawn(fig: plt.Figure | None, path: Path) -> Path | None:
    return None if fig is None else save_figure(fig, path)
