"""The sampler's top-k / top-p rows in one C call (``engine/csrc/filtered_draw.c``; CPU float32).

A top-p row in PyTorch is ~25 small ops after the softmax (``torch.topk`` over the vocabulary,
two sorts of the candidates, gathers, a float64 cumsum, a searchsorted...): at batch 1 they cost
~1 ms of a ~8 ms decode step on two cores, while a greedy pick is one ``max``. The kernel does
the same per row in three passes over the probabilities (their maximum; counts and masses above
six thresholds; the candidates at the chosen one), then ranks and walks only the candidates.

It returns exactly the token ``engine.sampling_filters.top_k_top_p_sorted`` followed by
``engine.sampler.draw`` returns for the same probabilities and uniform: the same ranking, the
same float64 sums in the same order (the C file's header has the argument that the candidate
set holds the head). ``tests/test_sampling_and_stopping`` checks it against that reference on
the distributions built to stress the candidate set, at every candidate threshold.
"""
from __future__ import annotations

import ctypes

import torch

from engine import native

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

#: Candidate thresholds before every token is ranked (``LEVELS`` in the C file).
LEVELS = 6


class FilteredDraw:
    """The compiled kernel (built on construction).

    Args:
        first_level: the candidate threshold every row tries first: ``None`` picks, per row, the
            highest one whose counts say it is enough; ``0 .. LEVELS`` forces one (``LEVELS``:
            every token). Forcing changes no token, only the cost (the tests force each).
    """

    def __init__(self, first_level: int | None = None) -> None:
        if first_level is not None and not 0 <= first_level <= LEVELS:
            raise ValueError(f"first_level must be None or in [0, {LEVELS}], got {first_level}")
        self.first_level = -1 if first_level is None else first_level
        self._draw = native.function("filtered_draw", "filtered_draw_f32", [_P, _I64, _I64, _P, _P, _P, _P, _INT, _P], _I64)

    def __call__(self, probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, row_mass: torch.Tensor,
                 u: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(tokens, rows widened): per row of ``probs`` ([rows, vocab], float32 on the CPU), the
        token drawn with ``u`` from the head ``top_k`` (int64; the vocabulary size for none) and
        ``top_p`` (float32; 1.0 for none) keep, top-p measured against ``row_mass`` (float64, the
        row's total) without top-k; and how many rows needed more than their first candidate set."""
        native.require_cpu_float32(probs, "the filtered draw", "probs")
        probs = probs.contiguous()
        rows, vocab = probs.shape
        arguments = [(top_k, torch.int64, "top_k"), (top_p, torch.float32, "top_p"),
                     (row_mass, torch.float64, "row_mass"), (u, torch.float64, "u")]
        for tensor, dtype, label in arguments:
            if tensor.dtype != dtype or tensor.device.type != "cpu" or tensor.shape != (rows,):
                raise ValueError(f"the filtered draw needs {label} as {rows} {dtype} values on the CPU, "
                                 f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}")
        top_k, top_p, row_mass, u = (t.contiguous() for t, _, _ in arguments)
        tokens = torch.empty(rows, dtype=torch.int64)
        widened = self._draw(probs.data_ptr(), rows, vocab, top_k.data_ptr(), top_p.data_ptr(), row_mass.data_ptr(),
                             u.data_ptr(), self.first_level, tokens.data_ptr())
        return tokens, int(widened)
