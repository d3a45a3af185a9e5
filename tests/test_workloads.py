"""Workload generators: reproducible, shaped as documented, special ids avoided."""
from __future__ import annotations

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from experiments.harness import workloads
from engine.tokenizer import load_tokenizer
from experiments.harness.chat_prompts import prompt_bank
from experiments.harness.workloads import gamma_arrival_offsets
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

VOCAB, SPECIAL = 64, (0, 1, 2)


def all_tokens(requests: list[workloads.WorkloadRequest]) -> set[int]:
    return {t for r in requests for t in r.prompt_token_ids}


@pytest.mark.parametrize("name", ["four_prompts", "burst", "poisson", "shared_prefix", "long_context"])
def test_deterministic_for_a_seed_and_avoids_special_ids(name: str) -> None:
    generate = getattr(workloads, name)
    first, again, other = (generate(VOCAB, SPECIAL, seed=s) for s in (3, 3, 4))
    assert first == again
    assert first != other
    assert not all_tokens(first) & set(SPECIAL)
    assert all(0 <= t < VOCAB for t in all_tokens(first))
    assert all(r.sampling_params.ignore_eos for r in first)
    offsets = [r.arrival_offset_s for r in first]
    assert offsets == sorted(offsets)
    assert len({r.request_id for r in first}) == len(first)


def test_four_prompts_three_short_one_long() -> None:
    requests = workloads.four_prompts(VOCAB, SPECIAL, short_max_tokens=5, long_max_tokens=50)
    assert [r.sampling_params.max_tokens for r in requests] == [5, 5, 5, 50]
    assert all(r.arrival_offset_s == 0 for r in requests)


def test_burst_is_two_c_requests_at_zero_within_ranges() -> None:
    requests = workloads.burst(VOCAB, SPECIAL, concurrency=8)
    assert len(requests) == 16
    assert all(r.arrival_offset_s == 0.0 for r in requests)
    assert all(16 <= len(r.prompt_token_ids) <= 128 for r in requests)
    assert all(8 <= r.sampling_params.max_tokens <= 64 for r in requests)
    assert len({len(r.prompt_token_ids) for r in requests}) > 1  # uneven


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_inter_arrivals_have_mean_one_over_rate(burstiness: float) -> None:
    rate = 4.0
    offsets = gamma_arrival_offsets(20_000, rate, burstiness, np.random.default_rng(0))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Gamma(k, 1/(rate k)) has variance 1/(rate^2 k): coefficient of variation 1/sqrt(k)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_poisson_workload_rate() -> None:
    requests = workloads.poisson(VOCAB, SPECIAL, num_requests=2000, rate=10.0)
    assert requests[-1].arrival_offset_s / (len(requests) - 1) == pytest.approx(0.1, rel=0.06)
    assert all(r.arrival_offset_s == 0 for r in workloads.poisson(VOCAB, SPECIAL, num_requests=5, rate=float("inf")))


def test_shared_prefix_shares_the_system_prompt() -> None:
    requests = workloads.shared_prefix(VOCAB, SPECIAL, num_users=5, prefix_len=500, arrival_interval_s=0.5)
    prefix = requests[0].prompt_token_ids[:500]
    assert all(r.prompt_token_ids[:500] == prefix for r in requests)
    assert len({tuple(r.prompt_token_ids[500:]) for r in requests}) == 5  # own questions
    assert [r.arrival_offset_s for r in requests] == [0.0, 0.5, 1.0, 1.5, 2.0]


def test_long_context_lengths() -> None:
    requests = workloads.long_context(VOCAB, SPECIAL, num_users=3, context_len=700)
    assert [len(r.prompt_token_ids) for r in requests] == [700] * 3


@pytest.mark.parametrize("name", ["four_prompts", "burst", "poisson", "shared_prefix", "long_context", "chat"])
def test_workload_yaml_instantiates(name: str) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"workload={name}", "model=tiny"])
    requests = instantiate(cfg.workload, vocab_size=VOCAB, special_token_ids=list(SPECIAL))
    assert requests and all(isinstance(r, workloads.WorkloadRequest) for r in requests)


def test_special_token_ids_reads_model_configs() -> None:
    class Config:
        bos_token_id = 1
        eos_token_ids = (2, 3)
        pad_token_id = None

    assert workloads.special_token_ids(Config()) == [1, 2, 3]


def test_chat_prompt_bank_is_large_and_varied() -> None:
    bank = prompt_bank()
    assert len(bank) >= 300 and len(set(bank)) == len(bank)
    lengths = sorted(len(p) for p in bank)
    assert lengths[0] < 30 and lengths[-1] > 200  # one-liners to multi-sentence notes


def test_chat_workload_seeded_selection_with_eos() -> None:
    first, again, other = (workloads.chat(VOCAB, SPECIAL, seed=s, num_requests=40) for s in (3, 3, 4))
    assert first == again and first != other
    prompts = [r.prompt_text for r in first]
    assert len(set(prompts)) == 40 and set(prompts) <= set(prompt_bank())  # no repeats while the bank lasts
    assert all(not r.sampling_params.ignore_eos and r.prompt_token_ids == [] for r in first)
    assert all(r.messages[-1]["role"] == "user" for r in first)
    with_system = workloads.chat(VOCAB, SPECIAL, seed=3, num_requests=2, system_prompt="Be brief.")
    assert with_system[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert with_system[0].prompt_text == workloads.chat(VOCAB, SPECIAL, seed=3, num_requests=2)[0].prompt_text


def test_tokenize_requests_renders_the_chat_template(byte_text_ckpt) -> None:
    tokenizer = load_tokenizer(byte_text_ckpt)
    requests = workloads.chat(VOCAB, SPECIAL, seed=0, num_requests=3) + workloads.burst(VOCAB, SPECIAL, concurrency=1)
    rendered = workloads.tokenize_requests(requests, tokenizer)
    for before, after in zip(requests[:3], rendered[:3]):
        text = f"<s>user: {before.prompt_text}\n<s>assistant: "
        assert after.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert rendered[3:] == requests[3:]  # token-id requests unchanged
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        workloads.tokenize_requests(requests, None)


def test_special_token_ids_include_the_tokenizers_control_tokens(byte_text_ckpt) -> None:
    class Config:
        bos_token_id = 256
        eos_token_ids = (257,)

    assert workloads.special_token_ids(Config(), load_tokenizer(byte_text_ckpt)) == [256, 257, 258]


def test_interactive_fraction_assigns_two_priority_classes() -> None:
    requests = workloads.poisson(vocab_size=500, num_requests=40, interactive_fraction=0.2, seed=3)
    priorities = [r.sampling_params.priority for r in requests]
    assert priorities.count(0) == 8 and priorities.count(1) == 32
    again = workloads.poisson(vocab_size=500, num_requests=40, interactive_fraction=0.2, seed=3)
    assert [r.sampling_params.priority for r in again] == priorities
    plain = workloads.poisson(vocab_size=500, num_requests=40, seed=3)
    assert {r.sampling_params.priority for r in plain} == {0}
    # the classes do not change the requests themselves
    assert [r.prompt_token_ids for r in plain] == [r.prompt_token_ids for r in requests]
    with pytest.raises(ValueError, match="interactive_fraction"):
        workloads.burst(vocab_size=500, interactive_fraction=1.5)


def test_shared_prefix_leader_arrives_ahead() -> None:
    requests = workloads.shared_prefix(vocab_size=500, num_users=4, arrival_interval_s=0.0, leader_lead_s=0.1)
    assert [r.arrival_offset_s for r in requests] == [0.0, 0.1, 0.1, 0.1]
