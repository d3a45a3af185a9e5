"""The sampler draws from exactly the distribution its filters define, and requests stop for the
right reason.

Distributions: 40,000 draws from one logits row per case, compared with a chi-square test
(``scipy.stats.chisquare``, fixed seed) to a float64 reference written here from the definitions
(temperature, then min-p, top-k, and top-p on what is left, as vLLM orders them). Each case also
names a plausible *wrong* filter (the top-k off by one, top-p measured before top-k, min-p before
temperature...) and asserts that the same draws reject it: the test can tell them apart. The
draws run three times: with the default candidate set, with 4 candidates, where some cases rank
their head among the candidates and others (top-p 0.7 needs more than 4 tokens) widen to the
full sort, and with the C kernels (``engine.sampling_kernels``).

Candidates: on distributions built to stress the candidate set (flat rows whose top-p head is
most of the vocabulary, one dominant token with top-p near 1, ties at the top-k, at the top-p cut
and at the candidates' edge, top-k above the candidate count, min-p leaving fewer tokens than
candidates), the head ranked among candidates is the full sort's — the same ids in the same order
with the same weights — wherever it claims to be, each row claims it at the candidate count it
was built for (the first set, the set widened once, or only the full sort), and the sampler's
tokens, seeded or not, equal draws from the full sort with the same uniforms: the PyTorch
candidates' and the C kernel's from whichever candidate threshold it starts. The C kernel for
plain rows draws from the same softmax with its own ``exp``: its tokens equal PyTorch's for all
but rare uniforms, which the test bounds.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine import LLM, SamplingParams
from engine.sampling_kernels import LEVELS, SamplingKernels
from engine.sampler import RowFilters, Sampler, draw, greedy_tokens
from engine.sampling_filters import row_mass, temperature_min_p, top_k_top_p_candidates, top_k_top_p_sorted

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


SAMPLERS = {  # name: the sampler's keyword arguments besides its seed
    "4 candidates": {"candidates": 4},
    "64 candidates": {"candidates": 64},
    "C kernels": {"kernels": SamplingKernels()},
}


def draw_counts(params: SamplingParams, sampler: dict, seed: int = 1234) -> np.ndarray:
    """Token counts of DRAWS samples of the engine's sampler from LOGITS."""
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(DRAWS, 1)
    rows = [SimpleNamespace(sampling_params=params, num_output_tokens=0)] * DRAWS
    tokens = Sampler(seed, **sampler)(logits, rows)
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


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_sampler_matches_reference_distribution(case, sampler):
    params, right, wrong = CASES[case]
    counts = draw_counts(params, SAMPLERS[sampler])
    assert fit_pvalue(counts, reference(**right)) > 1e-3, f"{case}: draws do not fit the definition"
    assert fit_pvalue(counts, reference(**wrong)) < 1e-6, f"{case}: the test cannot tell the wrong filter apart"


STRESS_VOCAB, STRESS_CANDIDATES, STRESS_GROWTH = 4096, 64, 16
STRESS_SIZES = (STRESS_CANDIDATES, STRESS_CANDIDATES * STRESS_GROWTH)  # then 16,384 >= the vocabulary: the full sort


def stress_rows() -> list[tuple[str, torch.Tensor, SamplingParams, int]]:
    """(name, logits row, params, stage): the row's head is provably held by STRESS_SIZES[stage]
    candidates and not by fewer (stage 2: only by the full sort)."""
    gen = torch.Generator().manual_seed(0)
    flat = 0.01 * torch.randn(STRESS_VOCAB, generator=gen)
    peaked = 3.0 * torch.randn(STRESS_VOCAB, generator=gen)
    dominant = 0.5 * torch.randn(STRESS_VOCAB, generator=gen)
    dominant[1234] = 12.0  # ~97% of the mass; the rest is a flat tail
    tie_at_k = -5.0 + 0.1 * torch.randn(STRESS_VOCAB, generator=gen)
    tie_at_k[[900, 901, 902]] = torch.tensor([10.0, 9.0, 8.0])
    tie_at_k[[3000, 7, 2000, 50, 100]] = 7.0  # top_k = 5 keeps two of these five: ids 7 and 50
    tie_at_edge = -20.0 + 0.1 * torch.randn(STRESS_VOCAB, generator=gen)
    tie_at_edge[:60] = torch.linspace(2.0, 1.0, 60)
    tie_at_edge[torch.arange(10) * 400 + 100] = 0.5  # ranks 60-69: across the 64 candidates' edge
    tie_at_p = torch.full((STRESS_VOCAB,), -10.0)
    tie_at_p[[3000, 12, 2500, 700, 40]] = 3.0  # top_p = 0.5 keeps three of these five: ids 12, 40 and 700
    return [
        ("flat, top-p head ~90% of the vocabulary", flat, SamplingParams(temperature=1.0, top_p=0.9), 2),
        ("flat, top-p 0.2: a head of ~800", flat, SamplingParams(temperature=1.0, top_p=0.2), 1),
        ("peaked, temperature 0.7, top-p 0.9", peaked, SamplingParams(temperature=0.7, top_p=0.9), 0),
        ("peaked, temperature 0.7, top-p 0.999: a head of ~650", peaked, SamplingParams(temperature=0.7, top_p=0.999), 1),
        ("one dominant token, top-p 0.9", dominant, SamplingParams(temperature=1.0, top_p=0.9), 0),
        ("one dominant token, top-p 0.99: the head runs into the flat tail", dominant,
         SamplingParams(temperature=1.0, top_p=0.99), 2),
        ("tie across the top-k boundary", tie_at_k, SamplingParams(temperature=1.0, top_k=5), 0),
        ("tie across the top-p cut", tie_at_p, SamplingParams(temperature=1.0, top_p=0.5), 0),
        ("tie across the candidates' edge, top-p into it", tie_at_edge, SamplingParams(temperature=1.0, top_p=0.999), 1),
        ("min-p leaves fewer tokens than candidates", peaked, SamplingParams(temperature=1.0, min_p=0.05, top_p=0.95), 0),
        ("flat, top-k 50 then top-p 0.5", flat, SamplingParams(temperature=1.0, top_k=50, top_p=0.5), 0),
        ("flat, top-k 63: one short of the candidates", flat, SamplingParams(temperature=1.0, top_k=63), 0),
        ("flat, top-k 100 (more than the candidates), top-p 0.5", flat, SamplingParams(temperature=1.0, top_k=100, top_p=0.5), 0),
        ("flat, top-k 2,000 (more than the widened candidates), top-p 0.9", flat,
         SamplingParams(temperature=1.0, top_k=2000, top_p=0.9), 0),
    ]


def full_sort_head(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    filters = RowFilters.of(params, logits.shape[-1], logits.device)
    probs = temperature_min_p(logits, filters.temperature, filters.min_p)
    return top_k_top_p_sorted(probs, filters.top_k, filters.top_p, row_mass(probs))


@pytest.mark.parametrize("stage", range(len(STRESS_SIZES)))
def test_candidate_head_is_the_full_sort_head_wherever_it_claims_to_be(stage):
    for name, logits, params, needs in stress_rows():
        filters = RowFilters.of([params], STRESS_VOCAB, logits.device)
        probs = temperature_min_p(logits[None], filters.temperature, filters.min_p)
        mass = row_mass(probs)
        size = max(STRESS_SIZES[stage], filters.max_top_k + 1)
        [ids], [weights], [exact] = top_k_top_p_candidates(probs, filters.top_k, filters.top_p, size, mass)
        [sorted_ids], [sorted_weights] = top_k_top_p_sorted(probs, filters.top_k, filters.top_p, mass)
        kept = sorted_weights > 0
        assert bool(exact) == (needs <= stage), name
        if exact:
            assert torch.equal(ids[weights > 0], sorted_ids[kept]), name
            assert torch.equal(weights[weights > 0], sorted_weights[kept]), name
        else:  # more candidates are needed: the full head reaches the candidates' smallest probability
            assert sorted_weights[kept][-1] <= probs[0].topk(size).values[-1], name
        if name.startswith("tie across the top-k"):
            assert sorted_ids[kept].tolist() == [900, 901, 902, 7, 50]  # ties: lower id first
        if name.startswith("tie across the top-p"):
            assert sorted_ids[kept].tolist() == [12, 40, 700]


STRESS_REPEAT = 40  # uniforms per stress row


def sampled_and_full_sort_tokens(sampler: Sampler, rows: tuple[torch.Tensor, ...], params: tuple[SamplingParams, ...]
                                 ) -> tuple[list[int], list[int]]:
    """``sampler``'s tokens for STRESS_REPEAT copies of the rows (odd copies with their own seeds,
    even ones on the shared generator of seed 3), and the full sort's draws with the same uniforms."""
    logits = torch.stack(rows).repeat(STRESS_REPEAT, 1)
    seqs = [SimpleNamespace(sampling_params=dataclasses.replace(p, seed=(7 * r + i if r % 2 else None)),
                            num_output_tokens=r)
            for r in range(STRESS_REPEAT) for i, p in enumerate(params)]
    tokens = sampler(logits, seqs)
    u = Sampler(seed=3).uniforms(seqs, logits.device)
    ids, weights = full_sort_head(logits, [seq.sampling_params for seq in seqs])
    return tokens, ids.gather(-1, draw(weights, u)[:, None]).squeeze(-1).tolist()


@pytest.mark.parametrize("with_top_k", [True, False])
def test_sampled_tokens_are_draws_from_the_full_sort_with_the_same_uniforms(with_top_k):
    """For rows with their own seed and rows on the shared generator. Without top-k rows (whose
    top_k sets the group's first candidate count), every stage runs: rows exact among the first
    candidates, after one widening, and only in the full sort."""
    _, rows, params, stages = zip(*[row for row in stress_rows() if with_top_k or row[2].top_k == 0])
    sampler = Sampler(seed=3, candidates=STRESS_CANDIDATES, growth=STRESS_GROWTH)
    tokens, full_sort_tokens = sampled_and_full_sort_tokens(sampler, rows, params)
    assert tokens == full_sort_tokens
    if not with_top_k:
        assert {1, 2} <= set(stages)
        assert sampler.widened == STRESS_REPEAT * sum(stage > 0 for stage in stages)


@pytest.mark.parametrize("first_level", [None, *range(LEVELS + 1)])
def test_the_c_kernel_draws_the_full_sort_tokens_from_every_candidate_threshold(first_level):
    """The C kernel (candidates by threshold) against the PyTorch full sort, on the stress rows
    and forty uniforms each: the same tokens, whichever threshold a row starts from. Started from
    the highest, the rows whose head needs more widen (the stress rows hold some at every stage)."""
    _, rows, params, stages = zip(*stress_rows())
    sampler = Sampler(seed=3, kernels=SamplingKernels(first_level))
    tokens, full_sort_tokens = sampled_and_full_sort_tokens(sampler, rows, params)
    assert tokens == full_sort_tokens
    if first_level == 0:
        assert sampler.widened >= STRESS_REPEAT * sum(stage > 0 for stage in stages)
    if first_level == LEVELS:  # every token ranked: nothing to widen
        assert sampler.widened == 0


def test_the_c_plain_draw_is_the_softmax_draw_but_for_rare_uniforms():
    """Temperatures 0.3-2 and min-p on logits of a vocabulary that is not a multiple of the
    kernel's 64-token blocks: the same token as PyTorch's softmax and draw for 500 uniforms per
    row but at most a few, which lie where the two float32 softmaxes round apart; never a
    zero-weight token (min-p's, a masked token's -inf logit, or past the row's end)."""
    generator = torch.Generator().manual_seed(5)
    vocab, rows = 4_133, 8
    logits = 4.0 * torch.randn(rows, vocab, generator=generator)
    logits[:, 5::97] = float("-inf")
    params = [SamplingParams(temperature=t, min_p=m) for t, m in
              [(0.5, 0.0), (1.0, 0.0), (2.0, 0.0), (0.7, 0.0), (1.0, 0.1), (1.5, 0.02), (1.0, 0.0), (0.3, 0.5)]]
    draws = 500
    logits, params = logits.repeat_interleave(draws, 0), [p for p in params for _ in range(draws)]
    seqs = [SimpleNamespace(sampling_params=p, num_output_tokens=i) for i, p in enumerate(params)]
    filters = RowFilters.of(params, vocab, logits.device)
    u = Sampler(seed=8).uniforms(seqs, logits.device)
    tokens = SamplingKernels().plain(logits, filters.temperature, filters.min_p, u)
    probs = temperature_min_p(logits, filters.temperature, filters.min_p)
    assert int((tokens != draw(probs, u)).sum()) <= 3
    assert bool((probs.gather(-1, tokens[:, None]) > 0).all())
    assert Sampler(seed=8, kernels=SamplingKernels())(logits, seqs) == tokens.tolist()


def test_the_c_plain_draw_never_picks_a_masked_token_at_the_uniforms_end():
    """u = 0 aims at the row's whole weight, which its float32 block sum may put a rounding past
    the float64 cumulative sum: the draw then falls back to the block's last weighted token, which
    must not be a -inf logit (a masked token)."""
    masked = float("-inf")
    logits = torch.tensor([[0.3, 2.0, 1.1, *[masked] * 7], [1.0, 2.0, *[masked] * 8]])
    tokens = SamplingKernels().plain(logits, torch.ones(2), None, torch.zeros(2, dtype=torch.float64))
    assert tokens.tolist() == [2, 1]


def test_the_c_kernels_name_what_they_need():
    probs = torch.full((2, 8), 0.125)
    top_k, top_p = torch.tensor([8, 2]), torch.tensor([0.5, 1.0])
    mass, u = torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    kernels = SamplingKernels()
    with pytest.raises(ValueError, match="float32 on the CPU"):
        kernels.filtered(probs.double(), top_k, top_p, mass, u)
    with pytest.raises(ValueError, match="top_p as 2 torch.float32"):
        kernels.filtered(probs, top_k, top_p.double(), mass, u)
    with pytest.raises(ValueError, match="u as 2 torch.float64"):
        kernels.plain(probs, top_p, None, u[:1])
    with pytest.raises(ValueError, match="first_level"):
        SamplingKernels(LEVELS + 1)
    assert kernels.filtered(probs, top_k, top_p, mass, u)[0].tolist() == [3, 1]  # ties rank by id: the draw's last kept
    assert kernels.plain(probs, top_p, None, u).tolist() == [7, 7]  # u = 0: the last token


@pytest.mark.parametrize("sampler", ["64 candidates", "C kernels"])
def test_a_seeded_request_draws_the_same_token_in_any_batch(sampler):
    _, rows, params, _ = zip(*stress_rows())
    seeded = [dataclasses.replace(p, seed=11 + i) for i, p in enumerate(params)]
    alone = [Sampler(**SAMPLERS[sampler])(row[None], [SimpleNamespace(sampling_params=p, num_output_tokens=5)])
             for row, p in zip(rows, seeded)]
    others = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.5)]
    batch = [SimpleNamespace(sampling_params=p, num_output_tokens=5) for p in [*others, *seeded, *others]]
    logits = torch.stack([rows[0], rows[1], rows[2], *rows, rows[3], rows[4], rows[5]])
    mixed = Sampler(seed=99, **SAMPLERS[sampler])(logits, batch)
    assert mixed[len(others):len(others) + len(seeded)] == [token for [token] in alone]


def test_greedy_tokens_are_argmax_with_its_first_index_on_ties():
    """The greedy pick (``max``'s indices, faster than ``argmax`` on a CPU) is ``argmax`` exactly:
    ties, rows of one value, bfloat16 logits, one row, and a greedy row beside sampled ones."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(33, 49152, generator=generator)
    logits[3, [100, 200, 40000]] = 1e9      # a three-way tie: the first index
    logits[5] = 0.0                         # every logit equal: index 0
    logits[7, -1] = 1e9                     # the last index
    for batch in (logits, logits.bfloat16(), logits[:1], logits[2:9]):
        assert torch.equal(greedy_tokens(batch), batch.argmax(dim=-1))
    assert greedy_tokens(logits)[3] == 100 and greedy_tokens(logits)[5] == 0 and greedy_tokens(logits)[7] == 49151
    seqs = [SimpleNamespace(sampling_params=SamplingParams(temperature=t, seed=1), seq_id=i, num_output_tokens=0)
            for i, t in enumerate([0.0, 1.0, 0.0])]
    tokens = Sampler(seed=0)(logits[:3], seqs)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_draw_never_reaches_a_zero_weight_token():
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    u = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)  # the two ends of [0, 1)
    assert draw(weights.repeat(2, 1), u.repeat_interleave(2)).tolist() == [3, 2, 1, 2]


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
