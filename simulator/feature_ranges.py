"""Where a calibration holds: the range of every cost-model feature its steps covered.

servelab fits whole steps (:mod:`simulator.cost_model`), not operators over a grid of shapes, so
a fit is only known to hold for steps like the ones it was fitted on. A step's **features** are
the quantities the cost model's terms grow with (:data:`FEATURES`), all read off its
:class:`engine.step_shape.StepShape`:

* ``sequences``: scheduled sequences (the per-sequence overhead);
* ``batch_rows``: token rows through the linear layers (GEMM and tile terms, the roofline);
* ``prefill_tokens``: prompt / chunk / recompute rows of the step (what a prefill chunk adds);
* ``context_tokens``: keys read by attention, summed over the step's sequences (the KV term);
* ``context_per_seq``: ``context_tokens / sequences``, the mean context of one sequence
  (a few long contexts and many short ones read the same sum, not the same way);
* ``shared_context_tokens``: context read from KV blocks another sequence of the step reads too
  (the shared-KV term; 0 without a prefix cache);
* ``attention_pairs``: the prefill query-key pairs the attention kernel computes (padded or causal:
  ``Hardware.attention_pairs``; the quadratic attention term).

A calibration (:mod:`experiments.calibration.calibrate`) writes ``[min, max]`` of each feature
over the steps it fitted into the hardware file (``feature_ranges``); a simulated run counts the
steps outside them (:mod:`simulator.extrapolation`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine.step_shape import StepShape

#: feature name -> what it is (the hardware file's comments and summary.md use these words)
FEATURES: dict[str, str] = {
    "sequences": "scheduled sequences per step",
    "batch_rows": "token rows per step (prefill + decode + wasted)",
    "prefill_tokens": "prefill / chunk / recompute rows per step",
    "context_tokens": "context tokens read per step",
    "context_per_seq": "context tokens per sequence (step mean)",
    "shared_context_tokens": "context tokens read from blocks shared within the step",
    "attention_pairs": "prefill query-key pairs the attention kernel computes",
}


@dataclass(frozen=True)
class FeatureRange:
    """The closed interval ``[low, high]`` of one feature that calibration steps covered."""

    low: float
    high: float

    def ratio_beyond(self, value: float) -> float:
        """How far ``value`` lies outside the range, as a ratio >= 1 (1.0: inside).

        Above: ``value / high``; below: ``low / value``; a value the calibration never came near
        (above a range whose top is 0, or 0 below a range starting above 0) is ``inf``."""
        if value > self.high:
            return value / self.high if self.high > 0 else float("inf")
        if value < self.low:
            return self.low / value if value > 0 else float("inf")
        return 1.0


def step_features(shape: StepShape, attention_pairs: str) -> dict[str, float]:
    """The step's value of every :data:`FEATURES` entry (``attention_pairs``: ``"padded"`` or ``"causal"``)."""
    return {
        "sequences": float(shape.num_seqs),
        "batch_rows": float(shape.num_rows),
        "prefill_tokens": float(shape.num_prefill_tokens),
        "context_tokens": float(shape.context_tokens),
        "context_per_seq": shape.context_tokens / shape.num_seqs if shape.num_seqs else 0.0,
        "shared_context_tokens": float(shape.shared_context_tokens),
        "attention_pairs": float(shape.padded_attention_pairs if attention_pairs == "padded"
                                 else shape.prefill_attention_pairs),
    }


def covered_ranges(shapes: Iterable[StepShape], attention_pairs: str) -> dict[str, FeatureRange]:
    """``[min, max]`` of every feature over ``shapes`` (at least one)."""
    values = [step_features(shape, attention_pairs) for shape in shapes]
    if not values:
        raise ValueError("no steps: a range needs at least one")
    return {name: FeatureRange(min(v[name] for v in values), max(v[name] for v in values)) for name in FEATURES}


def parse_ranges(raw: Mapping | None, where: str) -> dict[str, FeatureRange] | None:
    """A hardware file's ``feature_ranges`` (feature -> ``[min, max]``) checked and read, ``None`` if absent.

    Raises ``ValueError`` naming ``where`` and the field for an unknown or missing feature or a
    malformed range."""
    if raw is None:
        return None
    unknown = sorted(set(raw) - set(FEATURES))
    missing = sorted(set(FEATURES) - set(raw))
    if unknown or missing:
        raise ValueError(f"{where}: feature_ranges has unknown features {unknown} / lacks {missing}; "
                         f"expected {list(FEATURES)}")
    ranges = {}
    for name in FEATURES:
        bounds = raw[name]
        if isinstance(bounds, FeatureRange):
            ranges[name] = bounds
            continue
        try:
            low, high = (float(b) for b in bounds)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: feature_ranges.{name} must be [min, max], got {bounds!r}") from error
        if not 0 <= low <= high:
            raise ValueError(f"{where}: feature_ranges.{name} must have 0 <= min <= max, got [{low}, {high}]")
        ranges[name] = FeatureRange(low, high)
    return ranges


def ranges_yaml(ranges: Mapping[str, FeatureRange], indent: str = "  ") -> str:
    """The ``feature_ranges:`` block of a hardware file, one commented line per feature."""
    lines = ["feature_ranges:             # [min, max] the calibration steps covered; simulated runs count steps "
             "outside (summary.json: simulation.extrapolation)"]
    for name, description in FEATURES.items():
        r = ranges[name]
        lines.append(f"{indent}{name}: [{r.low:.6g}, {r.high:.6g}]   # {description}")
    return "\n".join(lines)
