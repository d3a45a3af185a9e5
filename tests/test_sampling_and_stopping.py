"""The sampler draws from exactly the distribution its filters define, and requests stop for the
right reason.

Distributions: 40,000 draws from one logits row per case, compared with a chi-square test
(``scipy.stats.chisquare``, fixed seed) to a float64 reference written here from the definitions
(temperature, then min-p, top-k, and top-p on what is left, as vLLM orders them). Each case also
names a plausible *wrong* filter (the top-k off by one, top-p measured before top-k, min-p before
temperature...) and asserts that the same draws reject it: the test can tell them apart.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine import LLM, SamplingParams
from engine.sampler import Sampler

LOGITS = np.array([2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.8, 0.6, 0.3, 0.0, -0.5, -1.0])
DRAWS = 40_000


def reference(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
              top_p_before_top_k: bool = False, top_p_keeps_crossing: bool = True,
              min_p_before_temperature: bool = False, min_p_last: bool = False) -> np.ndarray:
    """The sampling distribution from its definition; the flags give plausible wrong variants."""
    probs = softmax(LOGITS / temperature)
    min_p_base = softmax(LOGITS) if min_p_before_temperature else probs

    def apply_min_p(q: np.ndarray, base: np.ndarray) -> np.ndarray:
        return normalized(np.where(base >= min_p * base.max(), q, 0.0))

    def apply_top_k(q: np.ndarray) -> np.ndarray:
        if top_k <= 0:
            return q
        keep = np.zeros_like(q, dtype=bool)
        keep[np.argsort(-q, kind="stable")[:top_k]] = True
        return normalized(np.where(keep, q, 0.0))

    def top_p_mask(q: np.ndarray) -> np.ndarray:
        order = np.argsort(-q, kind="stable")
        mass_before = np.cumsum(q[order]) - q[order]
        mass_through = np.cumsum(q[order])
        kept = mass_before < top_p if top_p_keeps_crossing else (mass_through <= top_p) | (np.arange(q.size) == 0)
        keep = np.zeros_like(q, dtype=bool)
        keep[order[kept]] = True
        return keep

    q = probs if min_p_last else apply_min_p(probs, min_p_base)
    if top_p_before_top_k:  # top-p measured on the full distribution, then top-k
        q = apply_top_k(normalized(np.where(top_p_mask(q), q, 0.0)))
    else:
        q = apply_top_k(q)
        q = normalized(np.where(top_p_mask(q), q, 0.0))
    return apply_min_p(q, q) if min_p_last else q


def softmax(x: np.ndarray) -> np.ndarray:
    return normalized(np.exp(x - x.max()))


def normalized(q: np.ndarray) -> np.ndarray:
    return q / q.sum()


def draw_counts(params: SamplingParams, seed: int = 1234) -> np.ndarray:
    """Token counts of DRAWS samples of the engine's sampler from LOGITS."""
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(DRAWS, 1)
    rows = [SimpleNamespace(sampling_params=params, num_output_tokens=0)] * DRAWS
    tokens = Sampler(seed)(logits, rows)
    return np.bincount(tokens, minlength=LOGITS.size)


def fit_pvalue(counts: np.ndarray, dist: np.ndarray) -> float:
    """Chi-square p-value of ``counts`` under ``dist``; 0 if a token outside its support was drawn."""
    support = dist > 0
    if counts[~support].any():
        return 0.0
    return float(chisquare(counts[support], dist[support] * counts.sum()).pvalue)


CASES = {
    # name: (params, the reference's arguments, a wrong variant's arguments)
    "temperature": (SamplingParams(temperature=0.7), {"temperature": 0.7}, {"temperature": 1.0}),
    "top_k": (SamplingParams(temperature=1.0, top_k=5), {"top_k": 5}, {"top_k": 6}),
    "top_p": (SamplingParams(temperature=1.0, top_p=0.7), {"top_p": 0.7}, {"top_p": 0.7, "top_p_keeps_crossing": False}),
    "top_k_then_top_p": (SamplingParams(temperature=1.0, top_k=6, top_p=0.75), {"top_k": 6, "top_p": 0.75},
                         {"top_k": 6, "top_p": 0.75, "top_p_before_top_k": True}),
    "min_p_after_temperature": (SamplingParams(temperature=1.5, min_p=0.5), {"temperature": 1.5, "min_p": 0.5},
                                {"temperature": 1.5, "min_p": 0.5, "min_p_before_temperature": True}),
    "min_p_then_top_p": (SamplingParams(temperature=1.0, min_p=0.4, top_p=0.6), {"min_p": 0.4, "top_p": 0.6},
                         {"min_p": 0.4, "top_p": 0.6, "min_p_last": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampler_matches_reference_distribution(case):
    params, right, wrong = CASES[case]
    counts = draw_counts(params)
    assert fit_pvalue(counts, reference(**right)) > 1e-3, f"{case}: draws do not fit the definition"
    assert fit_pvalue(counts, reference(**wrong)) < 1e-6, f"{case}: the test cannot tell the wrong filter apart"


def test_min_p_is_validated():
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_eos_stop_token_ids_and_max_tokens_each_end_with_their_reason(tiny_llama_ckpt):
    llm = LLM(model=str(tiny_llama_ckpt), device="cpu", cache="paged", block_size=4, capacity_tokens=256)
    prompt = [7, 8, 9, 10, 11]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    stop_token, eos_token = free[5], free[3]
    # make free[3] the model's EOS (the random tiny model has no natural one in this continuation)
    llm.model_config = dataclasses.replace(llm.model_config, eos_token_ids=(eos_token,))
    outputs = llm.generate([prompt] * 4, [
        SamplingParams(max_tokens=12),                                              # ends at EOS
        SamplingParams(max_tokens=12, ignore_eos=True),                             # runs to max_tokens
        SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_token,)),  # ends at the stop id
        SamplingParams(max_tokens=2, ignore_eos=True),                              # max_tokens, short
    ])
    eos_cut, stop_cut = free.index(eos_token) + 1, free.index(stop_token) + 1
    assert [(o.finish_reason, o.token_ids) for o in outputs] == [
        ("stop", free[:eos_cut]), ("length", free), ("stop", free[:stop_cut]), ("length", free[:2]),
    ]
    llm.free_blocks_check()
