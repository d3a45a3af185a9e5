"""Time of one engine step from the batch the scheduler built, on a model of the hardware.

The step's shape (:class:`engine.step_shape.StepShape`) gives, per step: ``S`` sequences, ``T``
token rows, ``R`` sampled rows, ``C`` context tokens read and ``A`` query-key pairs of the prefill
rows (sequences computing more than one row; a decode row's attention is its context read): the
causal pairs for a fused attention kernel, or the padded rectangle ``n x max query x max context``
per attention call that a dense masked kernel computes (``Hardware.attention_pairs``: servelab's
gather backends pad; FlashAttention and paged kernels do not). With the model's shapes
(:mod:`simulator.model_shapes`) they become ideal times at datasheet peaks:

* ``t_lin  = (pad(T) * 2 * layer_params + pad(R) * 2 * vocab * hidden) / peak_flops``  (GEMMs; ``pad``: the
  rows a GEMM of more than ``small_batch_rows`` rows computes, up to its row bucket)
* ``t_small = t_lin`` if ``T <= small_batch_rows`` else 0                     (GEMMs of few rows)
* ``t_tail = (tail(T) * 2 * layer_params + tail(R) * 2 * vocab * hidden) / peak_flops``  (remainder tiles)
* ``t_w    = weight_bytes / bandwidth``                                    (stream the weights once)
* ``t_kv   = (C - C_shared) * kv_bytes_per_token / bandwidth``             (attention reads the KV cache)
* ``t_kv_shared = C_shared * kv_bytes_per_token / bandwidth``               (blocks another sequence of the step reads too)
* ``t_attn = A * 4 * layers * heads * head_dim / peak_flops``               (prefill attention)

and the step time is

    t = c_step + c_seq * S + max(c_lin * t_lin + c_small * t_small, c_w * t_w) + c_tail * t_tail
        + c_kv * t_kv + c_kv_shared * t_kv_shared + c_attn * t_attn

The ``max`` is the roofline of the linear layers: a small decode batch waits for the weights to
stream, a large prefill waits for the math. ``c_small`` prices the GEMM efficiency lost on
batches of few rows where the weight read does not bound them (a CPU: a decode row through a
few-row GEMM costs about twice a row of a large one). ``t_tail`` is tile quantization of the
few-row GEMM: it computes a batch in register tiles of ``small_batch_tile_rows`` rows, and the
rows left over (``tail``: :func:`tile_tail_rows`) run as smaller tiles, each one more pass over
the weights at a lower FMA rate, so 8 rows cost less than 7 (docs/simulator.md measures it).
``C_shared`` is the context read from KV blocks that an earlier sequence of the same step reads
too (a shared prefix in the prefix cache): the kernel reads it per sequence, but from the
CPU's / GPU's caches, so it costs less than memory reads (``c_kv_shared``; ``None`` in a hardware
file: as ``c_kv``).
Every ``c`` is >= 0: ``c_step`` / ``c_seq`` are overheads in seconds, the others are
1 / efficiency against the datasheet.

**Fitting** (``experiments.calibration.calibrate``): the ``max`` splits the steps into two regimes, so the fit
searches the crossover: for every candidate row count ``r`` (and "none"), steps of at most ``r``
rows are weight-bound (their row of the design matrix carries ``t_w`` and no GEMM terms), the
others compute-bound (GEMM terms, no ``t_w``), and ``t = X c`` is solved for
``c = (c_step, c_seq, c_lin, c_small, c_w, c_kv, c_attn, c_tail, c_kv_shared)`` by non-negative least squares
(``scipy.optimize.nnls``); the crossover with the smallest relative error wins. On one model the
weight read is the same every step, so ``c_w`` is identified only by the contrast between the
regimes; with no weight-bound steps it stays 0 and ``c_step`` holds the weight read. The targets
are the measured step durations plus the median gap between back-to-back steps (the driver's own
time, which a virtual clock must also pass).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.model_config import ModelConfig
from engine.weight_copies import onednn_row_bucket
from engine.step_shape import StepShape
from simulator import model_shapes
from simulator.hardware import Hardware

#: columns of the calibration design matrix, in order
FIT_TERMS = ("step_overhead_s", "seq_overhead_s", "linear_time_scale", "small_batch_time_scale", "weight_time_scale",
             "kv_time_scale", "attention_time_scale", "tile_tail_time_scale", "shared_kv_time_scale")
_GEMM_COLUMNS = [FIT_TERMS.index("linear_time_scale"), FIT_TERMS.index("small_batch_time_scale")]
_WEIGHT_COLUMN = FIT_TERMS.index("weight_time_scale")


def tile_tail_rows(rows: int, tile_rows: int, max_rows: int) -> int:
    """Rows of a ``rows``-row GEMM that the few-row kernel computes outside its full register
    tiles of ``tile_rows`` rows, counted in pairs (0 where the kernel is not used).

    servelab's skinny GEMM (``engine/csrc/gemm.c``) runs ``rows // tile_rows`` full tiles, then
    the rest as tiles of 4, 2 and 1 rows, each a further pass over the weights; a one-row tile
    costs as much as a two-row one (both are bound by loading the weights, not by the FMAs), so
    the remainder counts rounded up to even. A GEMM of one row is the plain weight stream (the
    weight term), nothing more. Measured on SmolLM2-135M's shapes in docs/simulator.md.
    """
    if tile_rows <= 0 or rows <= 1 or rows > max_rows:
        return 0
    rest = rows % tile_rows
    return rest + rest % 2


@dataclass(frozen=True)
class StepTerms:
    """Ideal times of one step at datasheet peaks (seconds), before coefficients."""

    num_seqs: int
    num_rows: int
    linear_s: float
    small_batch_linear_s: float
    weights_s: float
    kv_s: float
    attention_s: float
    tile_tail_s: float
    shared_kv_s: float

    def fit_row(self) -> list[float]:
        """The calibration features, in :data:`FIT_TERMS` order."""
        return [1.0, float(self.num_seqs), self.linear_s, self.small_batch_linear_s, self.weights_s, self.kv_s,
                self.attention_s, self.tile_tail_s, self.shared_kv_s]


class CostModel:
    """Prices steps of one model on one hardware; the per-unit constants are computed once."""

    def __init__(self, hardware: Hardware, model_config: ModelConfig) -> None:
        self.hardware = hardware
        flops, bandwidth, dtype_bytes = hardware.flops_per_s, hardware.bytes_per_s, hardware.dtype_bytes
        self.linear_s_per_row = model_shapes.linear_flops_per_token(model_config) / flops
        self.lm_head_s_per_row = model_shapes.lm_head_flops_per_row(model_config) / flops
        self.weights_s = model_shapes.weight_bytes_read_per_step(model_config, dtype_bytes) / bandwidth
        self.kv_s_per_token = model_shapes.kv_bytes_per_token(model_config, dtype_bytes) / bandwidth
        self.attention_s_per_pair = model_shapes.attention_flops_per_pair(model_config) / flops
        self.padded_attention = hardware.attention_pairs == "padded"

    def tail(self, rows: int) -> int:
        return tile_tail_rows(rows, self.hardware.small_batch_tile_rows, self.hardware.small_batch_rows)

    def padded(self, rows: int) -> int:
        """Rows a GEMM of ``rows`` rows computes: past the few-row path, up to its row bucket."""
        hw = self.hardware
        if hw.large_batch_row_buckets <= 0 or rows <= max(hw.small_batch_rows, 1):
            return rows
        return onednn_row_bucket(rows, hw.large_batch_row_buckets)

    def terms(self, shape: StepShape) -> StepTerms:
        linear_s = (self.padded(shape.num_rows) * self.linear_s_per_row
                    + self.padded(shape.num_sampled) * self.lm_head_s_per_row)
        return StepTerms(
            num_seqs=shape.num_seqs,
            num_rows=shape.num_rows,
            linear_s=linear_s,
            small_batch_linear_s=linear_s if shape.num_rows <= self.hardware.small_batch_rows else 0.0,
            weights_s=self.weights_s,
            kv_s=(shape.context_tokens - shape.shared_context_tokens) * self.kv_s_per_token,
            attention_s=(shape.padded_attention_pairs if self.padded_attention else shape.prefill_attention_pairs)
            * self.attention_s_per_pair,
            tile_tail_s=self.tail(shape.num_rows) * self.linear_s_per_row
            + self.tail(shape.num_sampled) * self.lm_head_s_per_row,
            shared_kv_s=shape.shared_context_tokens * self.kv_s_per_token,
        )

    def step_time(self, shape: StepShape) -> float:
        """Seconds the step takes on this hardware."""
        hw, terms = self.hardware, self.terms(shape)
        return (
            hw.step_overhead_s
            + hw.seq_overhead_s * terms.num_seqs
            + max(hw.linear_time_scale * terms.linear_s + hw.small_batch_time_scale * terms.small_batch_linear_s,
                  hw.weight_time_scale * terms.weights_s)
            + hw.tile_tail_time_scale * terms.tile_tail_s
            + hw.kv_time_scale * terms.kv_s
            + hw.shared_kv_scale * terms.shared_kv_s
            + hw.attention_time_scale * terms.attention_s
        )


@dataclass(frozen=True)
class Fit:
    """Result of a calibration fit.

    Attributes:
        coefficients: fitted values by name (:data:`FIT_TERMS`).
        r_squared: share of the variance of the kept steps' durations the fit explains.
        num_steps: steps offered; num_kept: steps the final fit used (the rest were disturbed).
        median_abs_rel_error: median |predicted - measured| / measured over the kept steps.
        kept: per step offered, whether the final fit used it.
    """

    coefficients: dict[str, float]
    r_squared: float
    num_steps: int
    num_kept: int
    median_abs_rel_error: float
    kept: tuple[bool, ...] = ()


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """NNLS with rows weighted by 1 / y (minimises relative error: a 4 s prefill and a 30 ms decode
    step count alike) and columns scaled to unit norm for conditioning."""
    from scipy.optimize import nnls

    weighted = x / y[:, None]
    norms = np.linalg.norm(weighted, axis=0)
    norms[norms == 0] = 1.0
    solution, _ = nnls(weighted / norms, np.ones_like(y))
    return solution / norms


def _regime_design(x: np.ndarray, weight_bound: np.ndarray) -> np.ndarray:
    """The design matrix with each step on one side of the ``max``: weight-bound rows keep ``t_w``
    and drop the GEMM terms, compute-bound rows the other way round."""
    design = x.copy()
    design[np.ix_(weight_bound, _GEMM_COLUMNS)] = 0.0
    design[~weight_bound, _WEIGHT_COLUMN] = 0.0
    return design


def predict(x: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """Step times of the rows of ``x`` (:meth:`StepTerms.fit_row`) under ``coefficients``, with the
    ``max`` of the module formula (what :meth:`CostModel.step_time` computes)."""
    gemm = x[:, _GEMM_COLUMNS] @ coefficients[_GEMM_COLUMNS]
    weights = x[:, _WEIGHT_COLUMN] * coefficients[_WEIGHT_COLUMN]
    rest = [i for i in range(x.shape[1]) if i not in (*_GEMM_COLUMNS, _WEIGHT_COLUMN)]
    return x[:, rest] @ coefficients[rest] + np.maximum(gemm, weights)


def _fit_regimes(x: np.ndarray, y: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """NNLS at every crossover (steps of <= r rows weight-bound; r = 0: none); the best by relative error."""
    best, best_error = None, np.inf
    for crossover in [0, *np.unique(rows)[:-1]]:
        coefficients = _nnls_relative(_regime_design(x, rows <= crossover), y)
        error = float(np.sum(((predict(x, coefficients) - y) / y) ** 2))
        if error < best_error:
            best, best_error = coefficients, error
    return best


def fit_coefficients(terms: Sequence[StepTerms], seconds: Sequence[float], disturbed_ratio: float = 1.5,
                     rounds: int = 5) -> Fit:
    """Non-negative least squares of ``seconds`` on the steps' :meth:`StepTerms.fit_row`, with the
    roofline's crossover searched (module docstring).

    On a shared machine some steps are slowed by other processes (CPU steal: a 50 ms decode step
    that takes 1.5 s). Such noise only ever adds time, so after each fit the steps measured over
    ``disturbed_ratio`` x their prediction are set aside and the fit is repeated (``rounds`` at
    most); :attr:`Fit.num_kept` says how many steps the final fit used.
    """
    if len(terms) != len(seconds) or not terms:
        raise ValueError(f"need one duration per step and at least one step, got {len(terms)} and {len(seconds)}")
    x = np.array([t.fit_row() for t in terms], dtype=np.float64)
    rows = np.array([t.num_rows for t in terms])
    y = np.asarray(seconds, dtype=np.float64)
    if (y <= 0).any():
        raise ValueError("step durations must be > 0")
    keep = np.ones(len(y), dtype=bool)
    for _ in range(rounds):
        coefficients = _fit_regimes(x[keep], y[keep], rows[keep])
        next_keep = y <= disturbed_ratio * predict(x, coefficients)
        if next_keep.sum() < x.shape[1] or (next_keep == keep).all():
            break
        keep = next_keep
    coefficients = _fit_regimes(x[keep], y[keep], rows[keep])
    kept_y, kept_predicted = y[keep], predict(x[keep], coefficients)
    total = ((kept_y - kept_y.mean()) ** 2).sum()
    r_squared = 1.0 - ((kept_y - kept_predicted) ** 2).sum() / total if total > 0 else 0.0
    return Fit(
        coefficients=dict(zip(FIT_TERMS, coefficients.tolist())),
        r_squared=float(r_squared),
        num_steps=len(y),
        num_kept=int(keep.sum()),
        median_abs_rel_error=float(np.median(np.abs(kept_predicted - kept_y) / kept_y)),
        kept=tuple(bool(k) for k in keep),
    )
