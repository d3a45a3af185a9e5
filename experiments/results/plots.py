"""Per-run PNG plots (matplotlib, Agg backend): KV memory, batch shape, TTFT distribution."""
from __future__ import annotations

from pathlib import Path

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
