"""Next-token selection: greedy, temperature, min-p, top-k, top-p, and per-request seeds.

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per vocabulary
entry), which draws exactly from ``p``. Its randomness is one noise vector per row, so a
request with a seed gets its own generator, seeded by ``(seed, output index)``: the token it
draws depends only on its own logits — not on what else is in the batch, on the strategies,
or on whether it was preempted and recomputed.
"""
from __future__ import annotations

import torch

from engine.sequence import Sequence

_SEED_STRIDE = 1_000_003


class Sampler:
    """Picks one token per row of a float32 logits matrix.

    Args:
        seed: seeds the generator shared by requests without their own seed.
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        greedy_tokens = logits.argmax(dim=-1)
        params = [seq.sampling_params for seq in seqs]
        if all(p.greedy for p in params):
            return greedy_tokens.tolist()
        probs = self.filtered_probs(logits, params)
        noise = self.exponential_noise(probs.shape, seqs)
        sampled_tokens = (probs / noise.to(probs.device)).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy_tokens, sampled_tokens).tolist()

    @staticmethod
    def filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
        """The distribution each row samples from, in vocabulary order (vLLM's order of filters):

        1. temperature: ``p = softmax(logits / T)``;
        2. min-p: drop tokens with ``p_i < min_p * max(p)``;
        3. top-k: keep the ``k`` most likely of the rest;
        4. top-p: renormalise what is left and keep its smallest head whose mass reaches
           ``top_p`` (the token that crosses it included; the most likely always stays);
        5. renormalise.
        """
        vocab_size = logits.shape[-1]
        device = logits.device
        temperatures = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        scaled = logits / temperatures[:, None]
        probs = scaled.softmax(dim=-1)
        scaled = scaled.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab_size, device=device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        return torch.zeros_like(logits).scatter_(1, sorted_ids, sorted_logits.softmax(dim=-1))

    def exponential_noise(self, shape: torch.Size, seqs: list[Sequence]) -> torch.Tensor:
        noise = torch.empty(shape).exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            seed = seq.sampling_params.seed
            if seed is not None:
                row_generator = torch.Generator().manual_seed((seed * _SEED_STRIDE + seq.num_output_tokens) % 2**63)
                noise[row].exponential_(generator=row_generator)
        return noise
