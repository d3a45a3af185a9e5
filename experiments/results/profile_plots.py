"""The plots of a load profile, from its table (:mod:`experiments.results.profile_table`).

Serving benchmarks draw a server's behaviour under load as curves over the **achieved** request
rate (what the server actually completed per second, not the rate asked for): latency stays
flat while the server keeps up and bends upward near its capacity.

* ``latency_vs_rate.png``: TTFT, ITL and E2E (p50 / p90 / p99) against the achieved request rate;
* ``goodput_vs_rate.png``: goodput (requests per second meeting every SLO) against the achieved
  request rate, beside the achieved rate itself (the diagonal: every request good); for
  max_goodput the probes are coloured by verdict and the rate found is marked.

Only runs whose status is ``ok`` are drawn; a plot with fewer than two such runs is not drawn.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.results.plots import plt, save_figure

LATENCIES = (("ttft_s", "TTFT (s)"), ("itl_s", "ITL (s)"), ("e2e_s", "E2E latency (s)"))
PERCENTILES = ("p50", "p90", "p99")
VERDICT_COLOURS = {"meets": "tab:green", "misses": "tab:red", "failed": "black"}


def _drawable(frame: pd.DataFrame) -> pd.DataFrame | None:
    ok = frame[frame["status"] == "ok"].dropna(subset=["request_throughput"]).sort_values("request_throughput")
    return ok if len(ok) >= 2 else None


def _mark_anchors(ax, ok: pd.DataFrame, column: str) -> None:
    """Name the synchronous and throughput points beside them."""
    for row in ok[ok["phase"].isin(("synchronous", "throughput"))].itertuples():
        ax.annotate(row.phase, (row.request_throughput, getattr(row, column)), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))


def plot_latency_vs_rate(frame: pd.DataFrame, path: Path, title: str) -> Path | None:
    """TTFT / ITL / E2E percentiles against the achieved request rate, one panel each."""
    ok = _drawable(frame)
    if ok is None:
        return None
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(5 * len(LATENCIES), 3.8))
    for ax, (metric, label) in zip(axes, LATENCIES):
        for percentile in PERCENTILES:
            ax.plot(ok["request_throughput"], ok[f"{metric}_{percentile}"], marker="o", label=percentile)
        _mark_anchors(ax, ok, f"{metric}_p99")
        ax.set(xlabel="achieved request rate (req/s)", ylabel=label)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_goodput_vs_rate(frame: pd.DataFrame, path: Path, title: str, max_goodput_rate: float | None = None) -> Path | None:
    """Goodput against the achieved request rate, the diagonal beside it; probes coloured by verdict."""
    ok = _drawable(frame)
    if ok is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ok["request_throughput"], ok["request_throughput"], linestyle="--", color="grey",
            label="achieved rate (every request good)")
    ax.plot(ok["request_throughput"], ok["goodput"], marker="o", label="goodput")
    _mark_anchors(ax, ok, "goodput")
    judged = ok[ok["verdict"].notna()]
    for verdict, part in judged.groupby("verdict"):
        ax.scatter(part["request_throughput"], part["goodput"], s=60, zorder=3,
                   color=VERDICT_COLOURS.get(verdict, "tab:blue"), label=f"probe {verdict} the SLO share")
    if max_goodput_rate is not None:
        ax.axvline(max_goodput_rate, color="tab:green", linestyle=":", label=f"max goodput rate {max_goodput_rate:.3g} req/s (target)")
    ax.set(xlabel="achieved request rate (req/s)", ylabel="goodput (req/s)", title=title)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_profile(frame: pd.DataFrame, out_dir: Path, title: str, max_goodput_rate: float | None = None) -> list[Path]:
    """Every profile plot that has data; returns the written files."""
    written = [plot_latency_vs_rate(frame, out_dir / "latency_vs_rate.png", title),
               plot_goodput_vs_rate(frame, out_dir / "goodput_vs_rate.png", title, max_goodput_rate)]
    return [p for p in written if p is not None]
