"""Seeded, reproducible request streams.

Every generator returns a list of :class:`WorkloadRequest` sorted by arrival offset. The
length-controlled workloads draw prompts as random token ids from ``[0, vocab_size)`` minus the
model's special ids (BOS, EOS, PAD and, with a real tokenizer, its control tokens such as chat-turn
markers), so no prompt ends early or looks like a document boundary; generated text is
meaningless and they run with ``ignore_eos`` so every request produces exactly ``max_tokens``
tokens (vLLM's random dataset does the same).

``chat`` is the real-text workload: questions and instructions from servelab's prompt bank
(:mod:`experiments.harness.chat_prompts`), sent as chat messages and rendered through the model's chat
template by :func:`tokenize_requests`; answers end at EOS, so output lengths are the model's own.

The same ``(parameters, seed, vocab_size, special ids)`` always gives the same requests, so two
engines fed the same workload see byte-identical prompts.

Generators are picked by ``conf/workload/*.yaml`` through ``_target_`` and called as
``hydra.utils.instantiate(cfg.workload, vocab_size=..., special_token_ids=...)``
(:func:`instantiate_workload`; a generator with a ``tokenizer`` parameter, a text workload such as
``dataset``, also gets the engine's tokenizer), then :func:`tokenize_requests` with the engine's
tokenizer.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from hydra.utils import get_method, instantiate

from engine.sampling_params import SamplingParams
from engine.tokenizer import decode, encode_chat, encode_prompt
from engine.tokenizer import special_token_ids as tokenizer_special_ids
from experiments.harness.chat_prompts import prompt_bank


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload.

    Attributes:
        request_id: stable name within the workload (``"req-0007"``), kept in every result file.
        prompt_token_ids: the prompt.
        sampling_params: how it is generated (greedy, ``ignore_eos`` by default).
        arrival_offset_s: when the request arrives, in seconds after the run starts.
        messages: a chat conversation (``{"role", "content"}`` dicts) whose rendering by the
            chat template becomes ``prompt_token_ids`` (:func:`tokenize_requests`); empty for
            token-id workloads.
        send_as_text: the prompt travels as plain text, as vLLM's benchmark client sends it, so
            every server tokenizes it itself: :func:`tokenize_requests` decodes the drawn ids to
            ``text`` and sets ``prompt_token_ids`` to that text's tokenization.
        text: the plain-text prompt of a ``send_as_text`` request (set by :func:`tokenize_requests`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_offset_s: float = 0.0
    messages: tuple[dict[str, str], ...] = ()
    send_as_text: bool = False
    text: str = ""

    @property
    def prompt_text(self) -> str:
        """What the user wrote: the last message of a chat request, a text prompt ("" for token-id prompts)."""
        return self.messages[-1]["content"] if self.messages else self.text


def text_of_length(tokenizer: Any, token_ids: Sequence[int], max_rounds: int = 10) -> tuple[str, list[int]]:
    """Text whose tokenization is (nearly always exactly) ``len(token_ids)`` tokens, and that tokenization.

    Random ids decoded to text do not re-encode to the same ids (neighbours merge, bytes split),
    so, like vLLM's random dataset, the ids are adjusted and decoded again: when the text encodes
    to ``d`` tokens too many, the last ``d`` decoded ids are dropped; ``d`` too few, ``d`` more of
    the drawn ids are appended (cyclically, so no special id comes in); at most ``max_rounds``
    rounds. The result is what every server's tokenizer sees, and ``prompt_token_ids`` is set to
    it, so lengths are counted as served.
    """
    target = len(token_ids)
    ids = list(token_ids)
    text = decode(tokenizer, ids)
    encoded = encode_prompt(tokenizer, text)
    for round_ in range(max_rounds):
        excess = len(encoded) - target
        if excess == 0 or not ids:
            break
        if excess > 0:
            ids = encoded[:target]
        else:
            ids = encoded + [token_ids[(round_ + k) % target] for k in range(-excess)]
        text = decode(tokenizer, ids)
        encoded = encode_prompt(tokenizer, text)
    return text, encoded


def tokenize_requests(requests: Sequence[WorkloadRequest], tokenizer: Any | None) -> list[WorkloadRequest]:
    """Chat requests with their messages rendered through the chat template into token ids; text
    requests (``send_as_text``) with their text and its tokenization (:func:`text_of_length`);
    token-id requests unchanged. ``ValueError`` if chat or text requests meet a model without a tokenizer."""
    if any(r.messages for r in requests) and tokenizer is None:
        raise ValueError("the chat workload needs a model with a tokenizer and chat template "
                         "(e.g. model=smollm2-135m-instruct)")
    if any(r.send_as_text for r in requests) and tokenizer is None:
        raise ValueError("workload.prompt_format=text needs a model with a tokenizer (e.g. model=smollm2-135m-instruct); "
                         "use workload.prompt_format=token_ids for a model without one")
    out = []
    for r in requests:
        if r.messages:
            r = replace(r, prompt_token_ids=encode_chat(tokenizer, r.messages))
        elif r.send_as_text and not r.text:
            text, ids = text_of_length(tokenizer, r.prompt_token_ids)
            r = replace(r, prompt_token_ids=ids, text=text)
        out.append(r)
    return out


def instantiate_workload(workload_cfg: Any, vocab_size: int, special_ids: Sequence[int], tokenizer: Any | None) -> Any:
    """Call the workload's ``_target_`` with the model's vocabulary size and special ids, and its
    tokenizer (``None`` for models without one) when the generator takes a ``tokenizer``."""
    extra = {"tokenizer": tokenizer} if "tokenizer" in inspect.signature(get_method(workload_cfg._target_)).parameters else {}
    return instantiate(workload_cfg, vocab_size=vocab_size, special_token_ids=special_ids, **extra)


class TokenSampler:
    """Draws random prompt token ids that avoid special ids, from one seeded generator."""

    def __init__(self, vocab_size: int, special_token_ids: Iterable[int], seed: int) -> None:
        special = {int(t) for t in special_token_ids if t is not None and 0 <= int(t) < vocab_size}
        self.allowed = np.array(sorted(set(range(vocab_size)) - special), dtype=np.int64)
        if self.allowed.size == 0:
            raise ValueError("every token id of the vocabulary is special")
        self.rng = np.random.default_rng(seed)

    def tokens(self, length: int) -> list[int]:
        return self.allowed[self.rng.integers(0, self.allowed.size, size=length)].tolist()

    def integer(self, low: int, high: int) -> int:
        """A uniform integer in ``[low, high]`` (both inclusive)."""
        return int(self.rng.integers(low, high + 1))


def special_token_ids(model_config: object, tokenizer: Any | None = None) -> list[int]:
    """BOS / EOS / PAD ids of a model config (servelab's ``ModelConfig`` or an HF config), plus
    every special or added token of ``tokenizer`` when there is one."""
    ids: list[int] = list(tokenizer_special_ids(tokenizer))
    for name in ("bos_token_id", "eos_token_id", "eos_token_ids", "pad_token_id"):
        value = getattr(model_config, name, None)
        if value is None:
            continue
        ids.extend(value if isinstance(value, (list, tuple)) else [value])
    return sorted({int(i) for i in ids})


def warmup_requests(vocab_size: int, special_ids: Sequence[int], count: int, prompt_len: int = 16) -> list[WorkloadRequest]:
    """Short untimed requests that pay the engine's first-call costs before a measured run."""
    sampler = TokenSampler(vocab_size, special_ids, seed=2**31 - 1)
    return [
        WorkloadRequest(f"warmup-{i}", sampler.tokens(prompt_len), _params(2, True, 0.0)) for i in range(count)
    ]


def _params(max_tokens: int, ignore_eos: bool, temperature: float, top_p: float = 1.0, top_k: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=temperature, top_p=top_p, top_k=top_k)


def with_priority_classes(
    requests: list[WorkloadRequest], interactive_fraction: float, seed: int,
    interactive_priority: int = 0, batch_priority: int = 1,
) -> list[WorkloadRequest]:
    """Split requests into two classes for ``scheduler.policy=priority``: a seeded random
    ``interactive_fraction`` of them (rounded) gets ``interactive_priority``, the rest
    ``batch_priority`` (lower is served first). ``interactive_fraction=0`` leaves every request
    at the default priority 0 (one class)."""
    if not 0.0 <= interactive_fraction <= 1.0:
        raise ValueError(f"interactive_fraction must be in [0, 1], got {interactive_fraction}")
    if interactive_fraction == 0.0:
        return requests
    rng = np.random.default_rng([seed, 2])
    interactive = set(rng.permutation(len(requests))[: round(interactive_fraction * len(requests))].tolist())
    return [
        replace(request, sampling_params=replace(
            request.sampling_params, priority=interactive_priority if i in interactive else batch_priority))
        for i, request in enumerate(requests)
    ]


def _name(index: int) -> str:
    return f"req-{index:04d}"


def uneven_requests(
    sampler: TokenSampler,
    arrival_offsets: Sequence[float],
    prompt_len_range: tuple[int, int],
    max_tokens_range: tuple[int, int],
    ignore_eos: bool,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
) -> list[WorkloadRequest]:
    """One request per arrival offset, prompt length and ``max_tokens`` uniform in their inclusive ranges."""
    requests = []
    for i, offset in enumerate(arrival_offsets):
        prompt = sampler.tokens(sampler.integer(*prompt_len_range))
        max_tokens = sampler.integer(*max_tokens_range)
        requests.append(WorkloadRequest(_name(i), prompt, _params(max_tokens, ignore_eos, temperature, top_p, top_k), offset))
    return requests


def four_prompts(
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    seed: int = 0,
    prompt_len: int = 8,
    short_max_tokens: int = 5,
    long_max_tokens: int = 50,
    long_first: bool = False,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> list[WorkloadRequest]:
    """Three short answers and one long one, all at t=0 (pico-vllm's naive-vs-continuous case).

    In one static batch the three short requests finish early and keep occupying their slots
    until the long one is done: ``3 * (long_max_tokens - short_max_tokens)`` wasted slots.
    ``long_first`` puts the long request first in arrival order (FCFS admits it first).
    """
    sampler = TokenSampler(vocab_size, special_token_ids, seed)
    max_tokens = [short_max_tokens] * 3 + [long_max_tokens]
    if long_first:
        max_tokens = max_tokens[::-1]
    return [
        WorkloadRequest(_name(i), sampler.tokens(prompt_len), _params(n, ignore_eos, temperature, top_p, top_k))
        for i, n in enumerate(max_tokens)
    ]


def burst(
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    seed: int = 0,
    concurrency: int = 8,
    requests_per_slot: int = 2,
    min_prompt_len: int = 16,
    max_prompt_len: int = 128,
    min_max_tokens: int = 8,
    max_max_tokens: int = 64,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    interactive_fraction: float = 0.0,
) -> list[WorkloadRequest]:
    """``requests_per_slot * concurrency`` requests at t=0 with uneven prompts and lengths (mini-vllm's benchmark).

    Prompt lengths and ``max_tokens`` are uniform integers in their (inclusive) ranges;
    ``interactive_fraction`` > 0 splits them into priority classes (:func:`with_priority_classes`).
    """
    sampler = TokenSampler(vocab_size, special_token_ids, seed)
    offsets = [0.0] * (requests_per_slot * concurrency)
    requests = uneven_requests(sampler, offsets, (min_prompt_len, max_prompt_len), (min_max_tokens, max_max_tokens),
                               ignore_eos, temperature, top_p, top_k)
    return with_priority_classes(requests, interactive_fraction, seed)


def gamma_arrival_offsets(num_requests: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Arrival offsets like vLLM's ``benchmark_serving``: the first request at t=0, then
    inter-arrival gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)) — mean 1/rate;
    burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular. ``rate=inf`` sends all at t=0.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate}, {burstiness}")
    if np.isinf(rate):
        return [0.0] * num_requests
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(num_requests - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:num_requests]


def poisson(
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    seed: int = 0,
    num_requests: int = 32,
    rate: float = 2.0,
    burstiness: float = 1.0,
    min_prompt_len: int = 16,
    max_prompt_len: int = 128,
    min_max_tokens: int = 8,
    max_max_tokens: int = 64,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    interactive_fraction: float = 0.0,
    system_prompt_len: int = 0,
) -> list[WorkloadRequest]:
    """Open-loop arrivals at ``rate`` req/s with gamma ``burstiness`` (see :func:`gamma_arrival_offsets`).

    ``interactive_fraction`` > 0 splits them into priority classes (:func:`with_priority_classes`).
    ``system_prompt_len > 0`` puts one shared system prompt of that many tokens (its own seeded
    stream: the rest of every request is unchanged) in front of every prompt, for prefix caching.
    """
    sampler = TokenSampler(vocab_size, special_token_ids, seed)
    offsets = gamma_arrival_offsets(num_requests, rate, burstiness, np.random.default_rng([seed, 1]))
    requests = uneven_requests(sampler, offsets, (min_prompt_len, max_prompt_len), (min_max_tokens, max_max_tokens),
                               ignore_eos, temperature, top_p, top_k)
    if system_prompt_len > 0:
        system = TokenSampler(vocab_size, special_token_ids, seed + 1_000_003).tokens(system_prompt_len)
        requests = [dataclasses.replace(r, prompt_token_ids=system + r.prompt_token_ids) for r in requests]
    return with_priority_classes(requests, interactive_fraction, seed)


def shared_prefix(
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    seed: int = 0,
    num_users: int = 8,
    prefix_len: int = 500,
    min_question_len: int = 8,
    max_question_len: int = 32,
    max_tokens: int = 16,
    arrival_interval_s: float = 0.0,
    leader_lead_s: float = 0.0,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> list[WorkloadRequest]:
    """One ``prefix_len``-token system prompt shared by every user plus a short question each
    (nano-vLLM's prefix-caching case). Users arrive ``arrival_interval_s`` apart (0 = together),
    so later users can hit blocks the first one published; ``leader_lead_s`` > 0 sends the first
    user that much ahead of the rest, so even users arriving together all find the prompt cached
    (and, with ``cache=prefix``, hold the same physical blocks: cascade attention's case).
    """
    sampler = TokenSampler(vocab_size, special_token_ids, seed)
    system_prompt = sampler.tokens(prefix_len)
    return [
        WorkloadRequest(
            _name(i),
            system_prompt + sampler.tokens(sampler.integer(min_question_len, max_question_len)),
            _params(max_tokens, ignore_eos, temperature, top_p, top_k),
            i * arrival_interval_s + (leader_lead_s if i > 0 else 0.0),
        )
        for i in range(num_users)
    ]


def long_context(
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    seed: int = 0,
    num_users: int = 4,
    context_len: int = 1024,
    max_tokens: int = 32,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> list[WorkloadRequest]:
    """A few users with long contexts, all at t=0: decode cost per 1,000 context tokens."""
    sampler = TokenSampler(vocab_size, special_token_ids, seed)
    return [
        WorkloadRequest(_name(i), sampler.tokens(context_len), _params(max_tokens, ignore_eos, temperature, top_p, top_k))
        for i in range(num_users)
    ]


def chat(
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    seed: int = 0,
    num_requests: int = 16,
    concurrency: int = 8,
    rate: float = float("inf"),
    burstiness: float = 1.0,
    max_tokens: int = 128,
    system_prompt: str | None = None,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> list[WorkloadRequest]:
    """``num_requests`` prompts drawn (seeded, without repeats while the bank lasts) from
    servelab's chat prompt bank, arriving at ``rate`` req/s (``inf``: all at t=0; see
    :func:`gamma_arrival_offsets`). Each is a one-turn conversation, optionally after a
    ``system_prompt`` (``None`` keeps the chat template's default system turn).

    ``vocab_size`` / ``special_token_ids`` are accepted like every generator's and unused: chat
    prompts are text. ``concurrency`` is read by the driver's client-side cap.
    """
    del vocab_size, special_token_ids, concurrency
    bank = prompt_bank()
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(bank), size=num_requests, replace=num_requests > len(bank))
    offsets = gamma_arrival_offsets(num_requests, rate, burstiness, np.random.default_rng([seed, 1]))
    system = ({"role": "system", "content": system_prompt},) if system_prompt else ()
    return [
        WorkloadRequest(_name(i), [], _params(max_tokens, ignore_eos, temperature, top_p, top_k), offset,
                        messages=(*system, {"role": "user", "content": bank[pick]}))
        for i, (pick, offset) in enumerate(zip(picks, offsets))
    ]
