"""A machine for the simulator: datasheet peaks plus the coefficients of the cost model.

``conf/hardware/<name>.yaml`` is one of two kinds:

* a **preset** (``calibrated: false``): datasheet numbers (dense bf16 tensor-core FLOP/s, memory
  bandwidth, memory size) and default coefficients that say how far below the datasheet a real
  serving engine runs. Every summary that uses one is labelled ``projected, uncalibrated``.
* a **calibration** (``calibrated: true``): written by ``python -m experiments.calibration.calibrate`` from
  real runs' ``steps.csv``; its coefficients are fitted to this machine and one model, and its
  ``feature_ranges`` say which steps they were fitted on (:mod:`simulator.feature_ranges`).

The coefficients are time multipliers on ideal times (1 / efficiency) and fixed overheads; the
formula is in :mod:`simulator.cost_model` and docs/simulator.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from simulator.feature_ranges import FeatureRange, parse_ranges

PROJECTED = "projected, uncalibrated"
ATTENTION_PAIRS = ("causal", "padded")  # see Hardware.attention_pairs


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or ``tensor_parallel`` of them) as the cost model sees it.

    Attributes:
        name: the preset / calibration name (``conf/hardware/<name>.yaml``).
        peak_tflops: dense peak of one device, TFLOP/s, in the simulated dtype.
        bandwidth_tbps: memory bandwidth of one device, TB/s.
        memory_gb: memory of one device, GB (1e9 bytes); ``None``: unknown (the KV budget then
            comes from ``cache.capacity_tokens``).
        tensor_parallel: devices a model is split over; peaks, bandwidth and memory scale with
            it, communication is not modelled (optimistic for > 1).
        dtype_bytes: bytes per weight and per K/V element (2 for bf16, 4 for float32).
        step_overhead_s: fixed seconds per step (launches, scheduling, sampling, the driver loop).
        seq_overhead_s: seconds per scheduled sequence (per-sequence bookkeeping and kernels).
        linear_time_scale: multiplier on linear-layer FLOPs / peak (1 / achieved MFU of GEMMs).
        small_batch_rows: steps of at most this many token rows run their GEMMs in the small-batch
            regime (0: no such regime; servelab's CPU engine: 24, the rows its few-row GEMM takes).
        small_batch_time_scale: extra multiplier on linear FLOPs / peak in that regime: a GEMM of a
            few rows reuses each weight it loads only a few times, so it runs further below peak
            than a large one (on GPUs the weight-read roofline covers this: 0 there).
        small_batch_tile_rows: rows of the few-row GEMM's full register tile (0: no tiling effect;
            servelab's CPU engine: 8 with AVX-512, 4 with AVX2). Rows of a step of at most
            ``small_batch_rows`` rows that do not fill a full tile run as smaller remainder tiles,
            each one more pass over the weights (:func:`simulator.cost_model.tile_tail_rows`).
        tile_tail_time_scale: multiplier on linear FLOPs / peak of those remainder rows (added,
            outside the roofline ``max``: they are passes over weights already streamed).
        large_batch_row_buckets: GEMMs of more than ``small_batch_rows`` rows run on rows padded up
            to buckets, this many per octave (servelab's prepacked oneDNN linears: 4, i.e. a
            multiple of a quarter of the power of two at or below; ``engine.weight_copies.onednn_row_bucket``);
            0: no padding. The padded rows are computed, so the GEMM FLOPs count them.
        weight_time_scale: multiplier on weight bytes / bandwidth (1 / achieved bandwidth share).
        kv_time_scale: multiplier on KV bytes read / bandwidth (attention's memory side).
        shared_kv_time_scale: multiplier on the bytes of KV blocks that another sequence of the
            same step reads too (a shared prefix: read again from the cache, not from memory);
            ``None``: as ``kv_time_scale`` (no reuse assumed; a calibration without shared blocks
            cannot tell).
        attention_time_scale: multiplier on attention FLOPs / peak (quadratic prefill term).
        attention_pairs: which query-key pairs of prompt / chunk rows the attention kernel computes:
            ``"causal"`` (fused paged / flash kernels skip masked keys; the presets) or ``"padded"``
            (dense masked attention over each call's padded batch: servelab's gather backends
            ``torch_sdpa`` / ``eager``, what a CPU calibration of them records). See
            :mod:`engine.step_shape`.
        calibrated: fitted on a real machine (``experiments.calibration.calibrate``) rather than a datasheet.
        calibrated_model: the model the calibration ran (its weight read hides in the step overhead).
        calibration: how the file was made (command, runs, date, fit quality).
        feature_ranges: ``[min, max]`` of each cost-model feature over the calibration's steps
            (:mod:`simulator.feature_ranges`; read into :class:`FeatureRange`); ``None``: a preset,
            or a calibration written before ranges were recorded. Simulated runs count the steps
            outside them (:mod:`simulator.extrapolation`).
    """

    name: str
    peak_tflops: float
    bandwidth_tbps: float
    memory_gb: float | None = None
    tensor_parallel: int = 1
    dtype_bytes: int = 2
    step_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    linear_time_scale: float = 1.0
    small_batch_rows: int = 0
    small_batch_time_scale: float = 0.0
    small_batch_tile_rows: int = 0
    tile_tail_time_scale: float = 0.0
    large_batch_row_buckets: int = 0
    weight_time_scale: float = 1.0
    kv_time_scale: float = 1.0
    shared_kv_time_scale: float | None = None
    attention_time_scale: float = 1.0
    attention_pairs: str = "causal"
    calibrated: bool = False
    calibrated_model: str | None = None
    calibration: str | None = None
    feature_ranges: Mapping[str, FeatureRange] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_ranges",
                           parse_ranges(self.feature_ranges, f"hardware {self.name!r}"))
        if self.peak_tflops <= 0 or self.bandwidth_tbps <= 0:
            raise ValueError(f"hardware {self.name!r}: peak_tflops and bandwidth_tbps must be > 0")
        if self.tensor_parallel < 1:
            raise ValueError(f"hardware {self.name!r}: tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"hardware {self.name!r}: dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")
        if self.attention_pairs not in ATTENTION_PAIRS:
            raise ValueError(f"hardware {self.name!r}: attention_pairs must be one of {ATTENTION_PAIRS}, "
                             f"got {self.attention_pairs!r}")
        scales = (self.step_overhead_s, self.seq_overhead_s, self.linear_time_scale, self.weight_time_scale,
                  self.kv_time_scale, self.attention_time_scale, self.small_batch_rows, self.small_batch_time_scale,
                  self.small_batch_tile_rows, self.tile_tail_time_scale, self.large_batch_row_buckets,
                  self.shared_kv_scale)
        if min(scales) < 0:
            raise ValueError(f"hardware {self.name!r}: overheads and time scales must be >= 0")

    @property
    def shared_kv_scale(self) -> float:
        """The multiplier shared KV blocks are priced with (``shared_kv_time_scale``, else ``kv_time_scale``)."""
        return self.kv_time_scale if self.shared_kv_time_scale is None else self.shared_kv_time_scale

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.tensor_parallel

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_tbps * 1e12 * self.tensor_parallel

    @property
    def memory_bytes(self) -> float | None:
        return None if self.memory_gb is None else self.memory_gb * 1e9 * self.tensor_parallel

    @property
    def timing_label(self) -> str:
        """What the times of a run on this hardware are: written into every summary."""
        if self.calibrated:
            return f"simulated, calibrated ({self.name}, on {self.calibrated_model})"
        return f"{PROJECTED} ({self.name} datasheet, tp={self.tensor_parallel})"
