"""The sampler's draws in one C call per step (``engine/csrc/sampling.c``; CPU float32).

In PyTorch, a sampled row is a chain of small ops over the 49,152-entry vocabulary. A plain row
(temperature, maybe min-p) takes a division, a softmax, a float64 cumulative sum and a search.
A top-k / top-p row takes ~25 ops after its softmax: ``torch.topk``, two sorts of the
candidates, gathers, a cumulative sum... At batch 1 these cost 0.5-1.1 ms of a ~8 ms decode step
on two cores, where a greedy pick is one ``max``.

* ``plain`` takes the logits and does temperature, softmax, min-p and the draw in one pass of a
  vectorised ``exp``, keeping only per-block sums. It draws from the softmax to float32
  rounding, as the PyTorch path does. Its ``exp`` is not PyTorch's, so for a rare uniform its
  token differs.
* ``filtered`` takes PyTorch's probabilities and returns exactly the token of
  ``engine.sampling_filters.top_k_top_p_sorted`` followed by ``engine.sampler.draw``: the same
  ranking, and the same float64 sums in the same order. It ranks only candidates chosen by a
  probability threshold (the C file's header has the argument that they hold the head).

``tests/test_sampling_and_stopping`` fits both to the definitions (chi-square). It also checks
``filtered`` token for token against the full sort, from every candidate threshold, on the
distributions built to stress the candidate set.
"""
from __future__ import annotations

import ctypes

import torch

from engine import native

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

#: Candidate thresholds before every token is ranked (``LEVELS`` in the C file).
LEVELS = 6


def _check_rows(rows: int, *arguments: tuple[torch.Tensor, torch.dtype, str]) -> None:
    for tensor, dtype, label in arguments:
        if tensor.dtype != dtype or tensor.device.type != "cpu" or tensor.shape != (rows,):
            raise ValueError(f"the sampling kernels need {label} as {rows} {dtype} values on the CPU, "
                             f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}")


class SamplingKernels:
    """The compiled kernels (built on construction).

    Args:
        first_level: the candidate threshold every top-k / top-p row tries first: ``None`` picks,
            per row, the highest one whose counts say it is enough; ``0 .. LEVELS`` forces one
            (``LEVELS``: every token). Forcing changes no token, only the cost (the tests force each).
    """

    def __init__(self, first_level: int | None = None) -> None:
        if first_level is not None and not 0 <= first_level <= LEVELS:
            raise ValueError(f"first_level must be None or in [0, {LEVELS}], got {first_level}")
        self.first_level = -1 if first_level is None else first_level
        self._plain = native.function("sampling", "plain_draw_f32", [_P, _I64, _I64, _P, _P, _P, _P])
        self._filtered = native.function("sampling", "filtered_draw_f32", [_P, _I64, _I64, _P, _P, _P, _P, _INT, _P], _I64)

    def plain(self, logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None,
              u: torch.Tensor) -> torch.Tensor:
        """Per row of ``logits`` ([rows, vocab], float32 on the CPU), the token drawn with ``u``
        (float64) from its softmax at ``temperature`` (float32, > 0), less the tokens ``min_p``
        (float32; ``None``: no row has one) drops."""
        native.require_cpu_float32(logits, "the sampling kernels", "logits")
        logits = logits.contiguous()
        rows, vocab = logits.shape
        _check_rows(rows, (temperature, torch.float32, "temperature"), (u, torch.float64, "u"),
                    *([] if min_p is None else [(min_p, torch.float32, "min_p")]))
        temperature, u = temperature.contiguous(), u.contiguous()
        tokens = torch.empty(rows, dtype=torch.int64)
        self._plain(logits.data_ptr(), rows, vocab, temperature.data_ptr(),
                    None if min_p is None else min_p.contiguous().data_ptr(), u.data_ptr(), tokens.data_ptr())
        return tokens

    def filtered(self, probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, row_mass: torch.Tensor,
                 u: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(tokens, rows widened): per row of ``probs`` ([rows, vocab], float32 on the CPU), the
        token drawn with ``u`` from the head ``top_k`` (int64; the vocabulary size for none) and
        ``top_p`` (float32; 1.0 for none) keep, top-p measured against ``row_mass`` (float64, the
        row's total) without top-k; and how many rows needed more than their first candidate set."""
        native.require_cpu_float32(probs, "the sampling kernels", "probs")
        probs = probs.contiguous()
        rows, vocab = probs.shape
        _check_rows(rows, (top_k, torch.int64, "top_k"), (top_p, torch.float32, "top_p"),
                    (row_mass, torch.float64, "row_mass"), (u, torch.float64, "u"))
        top_k, top_p, row_mass, u = (t.contiguous() for t in (top_k, top_p, row_mass, u))
        tokens = torch.empty(rows, dtype=torch.int64)
        widened = self._filtered(probs.data_ptr(), rows, vocab, top_k.data_ptr(), top_p.data_ptr(), row_mass.data_ptr(),
                                 u.data_ptr(), self.first_level, tokens.data_ptr())
        return tokens, int(widened)
