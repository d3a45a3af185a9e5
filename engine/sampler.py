"""Next-token selection: greedy, temperature, min-p, top-k, top-p, and per-request seeds.

A step's rows split three ways, and each pays only for what it uses:

* **greedy** rows (temperature 0): ``argmax`` of the logits;
* **plain** rows (temperature, maybe min-p; no top-k / top-p): one softmax over the vocabulary,
  min-p as a mask, and a draw in vocabulary order — no ranking at all;
* **filtered** rows (top-k and / or top-p): the head those filters keep, ranked among the
  ``candidates`` most likely tokens (``torch.topk``); a row whose head those candidates do not
  provably hold (``engine.sampling_filters`` has the proof) ranks ``growth`` times as many, and so
  on, and only a row whose head still falls short once the candidates would cover the vocabulary
  is sorted in full. Real answers' heads are short (a top-p 0.9 head at temperature 0.7 is tens
  of tokens), so most rows never widen; a flat row (a model unsure of its next token) widens
  once or twice instead of paying the full sort.

On a CPU with the engine's fused ops, float32 rows take one C call per group instead
(:mod:`engine.sampling_kernels`): a plain group's softmax and draw in one pass, and a filtered
group's ranking and draw over candidates chosen by a probability threshold rather than ``topk``
(the same head, sums and token). Both replace chains of small PyTorch ops that cost more than
the arithmetic at batch 1.

A draw is inverse-CDF sampling: one uniform ``u`` per sampled row (float64, on the logits'
device), and the token is the first whose cumulative weight reaches ``(1 - u)`` times the total
(float64 sums of the float32 weights). Zero-weight tokens can never be reached, so the draw is
exactly from the filtered distribution, and it needs one random number per row instead of one
per vocabulary entry. A request with a seed draws its ``u`` from its own generator, seeded by
``(seed, output index)``: the token it samples depends only on its own logits — not on what else
is in the batch, on the strategies, or on whether it was preempted and recomputed. Whether a
filtered row ranks candidates or the whole vocabulary depends on its own logits too, and both
rank the same head in the same order, so the same ``u`` picks the same token either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_kernels import SamplingKernels
from engine.sampling_filters import row_mass, temperature_min_p, top_k_top_p_candidates
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

_SEED_STRIDE = 1_000_003


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest logit: ``argmax``'s answer, through ``max``'s reduction
    (3x faster than ``argmax`` on a CPU for a [32, 49,152] batch, torch 2.13, 2026-12-06)."""
    return logits.max(dim=-1).indices


@dataclass(frozen=True)
class RowFilters:
    """One group of rows' filter settings as tensors on the logits' device (see ``engine.sampling_filters``)."""

    temperature: torch.Tensor
    min_p: torch.Tensor | None  # None when no row has one
    top_k: torch.Tensor  # the vocabulary size where a row has none
    top_p: torch.Tensor
    max_top_k: int  # the largest top_k below the vocabulary size (0 if none)

    @classmethod
    def of(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> RowFilters:
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device) if any(p.min_p > 0 for p in params) else None,
            top_k=torch.tensor(top_k, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            max_top_k=max((k for k in top_k if k < vocab_size), default=0),
        )


class Sampler:
    """Picks one token per row of a float32 logits matrix.

    Args:
        seed: seeds the generator shared by requests without their own seed.
        candidates: how many of the most likely tokens top-k / top-p rows rank first (at least
            one more than the largest top_k is taken).
        growth: the factor by which a row's candidates widen while its head needs more; a row
            is sorted in full once they would cover the vocabulary. Neither value changes a
            token; they only move the cost.
        kernels: the C kernels that draw a plain or a top-k / top-p group in one call each
            (:mod:`engine.sampling_kernels`; candidates by threshold, not ``candidates`` /
            ``growth``), for float32 logits on the CPU; ``None``, or logits elsewhere, take the
            PyTorch ops.

    ``widened`` counts the rows (over the sampler's life) whose head needed more than the first
    candidate set.
    """

    def __init__(self, seed: int = 0, candidates: int = 64, growth: int = 16,
                 kernels: SamplingKernels | None = None) -> None:
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {candidates}")
        if growth < 2:
            raise ValueError(f"growth must be >= 2, got {growth}")
        self.seed = seed
        self.candidates = candidates
        self.growth = growth
        self.kernels = kernels
        self.widened = 0
        self.generators: dict[torch.device, torch.Generator] = {}  # the shared one, per device

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        params = [seq.sampling_params for seq in seqs]
        if all(p.greedy for p in params):
            return greedy_tokens(logits).tolist()
        device = logits.device
        tokens = torch.empty(len(seqs), dtype=torch.long, device=device)
        greedy = [row for row, p in enumerate(params) if p.greedy]
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        if greedy:
            rows = torch.tensor(greedy, device=device)
            tokens[rows] = greedy_tokens(logits[rows])
        u = self.uniforms([seqs[row] for row in sampled], device)
        position = {row: i for i, row in enumerate(sampled)}
        plain = [row for row in sampled if params[row].top_k <= 0 and params[row].top_p >= 1.0]
        filtered = [row for row in sampled if params[row].top_k > 0 or params[row].top_p < 1.0]
        for group, pick in ((plain, self.pick_plain), (filtered, self.pick_filtered)):
            if len(group) == len(seqs):  # one kind of row: no indexing in or out
                return pick(logits, RowFilters.of(params, logits.shape[-1], device), u).tolist()
            if group:
                rows = torch.tensor(group, device=device)
                chosen = logits if len(group) == len(seqs) else logits[rows]
                filters = RowFilters.of([params[row] for row in group], logits.shape[-1], device)
                tokens[rows] = pick(chosen, filters, u[torch.tensor([position[row] for row in group], device=device)])
        return tokens.tolist()

    def uses_kernels(self, logits: torch.Tensor) -> bool:
        return self.kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32

    def pick_plain(self, logits: torch.Tensor, filters: RowFilters, u: torch.Tensor) -> torch.Tensor:
        if self.uses_kernels(logits):
            return self.kernels.plain(logits, filters.temperature, filters.min_p, u)
        return draw(temperature_min_p(logits, filters.temperature, filters.min_p), u)

    def pick_filtered(self, logits: torch.Tensor, filters: RowFilters, u: torch.Tensor) -> torch.Tensor:
        probs = temperature_min_p(logits, filters.temperature, filters.min_p)
        mass = row_mass(probs)
        top_k, top_p = filters.top_k, filters.top_p
        if self.uses_kernels(probs):
            tokens, widened = self.kernels.filtered(probs, top_k, top_p, mass, u)
            self.widened += widened
            return tokens
        size = max(self.candidates, filters.max_top_k + 1)
        tokens = torch.empty(len(probs), dtype=torch.long, device=probs.device)
        rows = torch.arange(len(probs), device=probs.device)  # the group's rows still to pick
        while True:
            ids, weights, exact = top_k_top_p_candidates(probs, top_k, top_p, size, mass)
            if bool(exact.all()):
                picked = ids.gather(-1, draw(weights, u)[:, None]).squeeze(-1)
                if len(rows) == len(tokens):  # every row's head among the first candidates
                    return picked
                tokens[rows] = picked
                return tokens
            done, left = exact.nonzero().squeeze(-1), (~exact).nonzero().squeeze(-1)
            tokens[rows[done]] = ids[done].gather(-1, draw(weights[done], u[done])[:, None]).squeeze(-1)
            if len(rows) == len(tokens):  # the first candidate set
                self.widened += len(left)
            rows, probs, top_k, top_p, mass, u = (t[left] for t in (rows, probs, top_k, top_p, mass, u))
            size *= self.growth

    def uniforms(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """One float64 uniform in [0, 1) per row: from the row's own generator where it has a seed."""
        u = torch.empty(len(seqs), dtype=torch.float64, device=device)
        shared = [row for row, seq in enumerate(seqs) if seq.sampling_params.seed is None]
        if shared:
            if device not in self.generators:
                self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
            u[torch.tensor(shared, device=device)] = torch.rand(
                len(shared), dtype=torch.float64, device=device, generator=self.generators[device])
        for row, seq in enumerate(seqs):
            seed = seq.sampling_params.seed
            if seed is not None:
                generator = torch.Generator(device=device).manual_seed((seed * _SEED_STRIDE + seq.num_output_tokens) % 2**63)
                u[row] = torch.rand((), dtype=torch.float64, device=device, generator=generator)
        return u


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the position whose cumulative weight first reaches ``(1 - u)`` times the row's total.

    ``1 - u`` is in (0, 1], so the target is in (0, total]: a zero-weight position is never the
    first to reach it, and the last positive one always does.
    """
    cumulative = weights.cumsum(dim=-1, dtype=torch.float64)
    target = (1.0 - u) * cumulative[:, -1]
    return torch.searchsorted(cumulative, target[:, None]).squeeze(-1)
