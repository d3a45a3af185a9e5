"""The filters that turn a row of logits into the weights its next token is drawn with.

vLLM's order of filters, per row:

1. temperature: ``p = softmax(logits / T)``;
2. min-p: drop tokens with ``p_i < min_p * max(p)``;
3. top-k: keep the ``k`` most likely of the rest;
4. top-p: of what is left, keep the smallest head (in rank order) whose mass reaches ``top_p``
   times the mass left (the token that crosses it included; the most likely always stays).

Steps 1-2 are elementwise over the vocabulary (``temperature_min_p``). Steps 3-4 keep a *head*
of the tokens ranked by probability, ties broken by lower token id, so they need a ranking — but
only of the head. ``top_k_top_p_sorted`` ranks the whole vocabulary (a stable sort: the
reference); ``top_k_top_p_candidates`` ranks only the ``n`` most likely tokens (``torch.topk``)
and says, per row, whether that was enough:

    Every token outside the candidates has ``p <= t``, the smallest candidate probability. If the
    last token of the head computed over the candidates has ``p > t``, every token of that head
    ranks above every non-candidate, so the candidates hold the whole head, in the same order
    (candidates are re-ranked by (probability desc, id asc), as the stable sort ranks them); the
    ranks that top-k counts are the same, and so are the masses top-p measures (the mass left
    after top-k is the sum of the first ``k`` probabilities, which are the same values in both
    rankings as long as ``n >= k``, or, with no top-k, the sum over the whole row). If the
    head reaches ``t`` (top-p needed more mass than the candidates hold, or a tie straddles the
    candidates' edge), the row is not exact: the caller ranks more candidates, or the whole row.

Both return the head as token ids in rank order and their weights (probabilities, zero past the
head), which ``engine.sampler`` draws from.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def temperature_min_p(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Each row's probabilities at its temperature, zero where min-p drops them (not renormalised).

    ``min_p`` is None when no row has one (saves the pass over the vocabulary).
    """
    probs = (logits / temperature[:, None]).softmax(dim=-1)
    if min_p is None:
        return probs
    return probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)


def row_mass(probs: torch.Tensor) -> torch.Tensor:
    """Each row's total probability as float64, for ``keep_head``: summed in the rows' own float32
    (a float64 sum would first copy the whole matrix into float64). Both rankings take the same
    value, so it cannot make them disagree; it is the mass top-p measures against to the float32
    precision the probabilities themselves have."""
    return probs.sum(dim=-1).double()


def top_k_top_p_sorted(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       row_mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights): the whole vocabulary ranked, and the head top-k and top-p keep.

    ``top_k`` holds the vocabulary size for rows without one; ``top_p`` holds 1.0 for rows without
    one; ``row_mass`` is ``row_mass(probs)`` (see ``keep_head``).
    """
    ranked, ids = probs.sort(dim=-1, descending=True, stable=True)
    return ids, keep_head(ranked, top_k, top_p, probs.shape[-1], row_mass)


def top_k_top_p_candidates(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, size: int,
                           row_mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, weights, exact): the ``size`` most likely tokens ranked, the head kept among them,
    and per row whether that head is the one ``top_k_top_p_sorted`` keeps (see the module docstring).

    ``size`` must be at least every row's ``top_k`` that is below the vocabulary size (one more
    spares a top-k-only row the fallback: its head then ends above the smallest candidate).
    ``row_mass`` as for ``top_k_top_p_sorted``. A ``size`` of the vocabulary or more is the full
    sort, exact in every row.
    """
    vocab_size = probs.shape[-1]
    if size >= vocab_size:
        ids, weights = top_k_top_p_sorted(probs, top_k, top_p, row_mass)
        return ids, weights, torch.ones(len(ids), dtype=torch.bool, device=ids.device)
    values, ids = probs.topk(size, dim=-1)
    ids, by_id = ids.sort(dim=-1)  # ties among candidates: lower id first, as the stable sort
    ranked, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    weights = keep_head(ranked, top_k, top_p, vocab_size, row_mass)
    last = ranked.gather(-1, (weights > 0).sum(dim=-1, keepdim=True) - 1).squeeze(-1)
    return ids, weights, last > ranked[:, -1]


def keep_head(ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, vocab_size: int,
              row_mass: torch.Tensor) -> torch.Tensor:
    """``ranked`` (probabilities in rank order, a row's first ``n``) with zeros past the top-k / top-p head.

    ``row_mass`` is each row's total probability (float64): the mass top-p measures against when
    the row has no top-k. With a top-k it is the sum of the first ``k``, taken here.
    """
    ranks = torch.arange(ranked.shape[-1], device=ranked.device)
    weights = ranked.masked_fill(ranks >= top_k[:, None], 0.0)
    mass_through = weights.cumsum(dim=-1, dtype=torch.float64)  # sequential: the same prefix gives the same sums
    mass = torch.where(top_k < vocab_size, mass_through[:, -1], row_mass)
    mass_before = F.pad(mass_through[:, :-1], (1, 0))
    crossed = (mass_before >= top_p[:, None].double() * mass[:, None]) & (top_p[:, None] < 1.0)
    return weights.masked_fill(crossed, 0.0)
