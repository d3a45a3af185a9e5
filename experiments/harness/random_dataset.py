"""``workload=random``: vLLM's random dataset, the shape serving benchmarks are quoted on.

``vllm bench serve --dataset-name random`` (``vllm/benchmarks/datasets.py``, ``RandomDataset``)
draws every request from three numbers and a ratio:

* an input length uniform in ``[floor(input_len * (1 - r)), ceil(input_len * (1 + r))]`` and an
  output length uniform in ``[max(1, floor(output_len * (1 - r))), ceil(output_len * (1 + r))]``,
  ``r = range_ratio`` (0: every request exactly ``input_len`` in, ``output_len`` out);
* ``prefix_len`` random tokens shared by every prompt, in front of its own input (prefix caching's
  case: a prompt is ``prefix_len + input`` tokens);
* random token ids, special ids avoided, generated with ``ignore_eos`` so every request produces
  exactly its output length.

vLLM's client sends those ids decoded to **text** (``prompt_format=text``): each server tokenizes
it, as it would a user's text, and the decoded text is adjusted so it re-encodes to the drawn
length (:func:`experiments.harness.workloads.text_of_length`, done by ``tokenize_requests`` with
the model's tokenizer). ``prompt_format=token_ids`` sends the ids themselves (no tokenizer needed,
no tokenization cost on the server).

Arrivals follow vLLM's ``--request-rate`` / ``--burstiness``
(:func:`experiments.harness.workloads.gamma_arrival_offsets`; ``inf`` = all at t=0) and the
client keeps at most ``concurrency`` requests in flight (``--max-concurrency``; the driver reads
``workload.concurrency``). ``num_prompts=None`` sends 4 x ``concurrency``, as the peer benchmark runs
vLLM's client. Sampling (``temperature``, ``top_p``, ``top_k``) is the same for every request.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

from experiments.harness.workloads import (
    TokenSampler, WorkloadRequest, _name, _params, gamma_arrival_offsets,
)

PROMPT_FORMATS = ("text", "token_ids")
PROMPTS_PER_USER = 4   # num_prompts=None: this many prompts per client slot


def length_range(length: int, range_ratio: float, minimum: int) -> tuple[int, int]:
    """vLLM's inclusive range ``[floor(len * (1 - r)), ceil(len * (1 + r))]``, at least ``minimum``."""
    return max(minimum, math.floor(length * (1 - range_ratio))), max(minimum, math.ceil(length * (1 + range_ratio)))


def prompt_count(num_prompts: int | None, concurrency: int | None) -> int:
    """``num_prompts``, or ``PROMPTS_PER_USER`` x ``concurrency`` when it is ``None``."""
    if num_prompts is None:
        if not concurrency:
            raise ValueError("workload=random needs workload.num_prompts when workload.concurrency is null")
        return PROMPTS_PER_USER * concurrency
    if num_prompts < 1:
        raise ValueError(f"workload.num_prompts must be >= 1, got {num_prompts}")
    return num_prompts


def random_dataset(
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    seed: int = 0,
    input_len: int = 128,
    output_len: int = 64,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    num_prompts: int | None = None,
    concurrency: int | None = 8,
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    prompt_format: Literal["text", "token_ids"] = "text",
    ignore_eos: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> list[WorkloadRequest]:
    """vLLM's random dataset (see the module docstring); ``ValueError`` names a field out of range."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"workload.prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError(f"workload.input_len and output_len must be >= 1 and prefix_len >= 0, "
                         f"got {input_len}, {output_len}, {prefix_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"workload.range_ratio must be in [0, 1), got {range_ratio}")
    count = prompt_count(num_prompts, concurrency)
    sampler = TokenSampler(vocab_size, special_token_ids, seed)
    prefix = sampler.tokens(prefix_len)
    inputs, outputs = length_range(input_len, range_ratio, 1), length_range(output_len, range_ratio, 1)
    offsets = gamma_arrival_offsets(count, request_rate, burstiness, np.random.default_rng([seed, 1]))
    requests = []
    for i, offset in enumerate(offsets):
        prompt = prefix + sampler.tokens(sampler.integer(*inputs))
        params = _params(sampler.integer(*outputs), ignore_eos, temperature, top_p, top_k)
        requests.append(WorkloadRequest(_name(i), prompt, params, offset, send_as_text=prompt_format == "text"))
    return requests
