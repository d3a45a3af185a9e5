"""workload=random (vLLM's random dataset): lengths within vLLM's ranges, the shared prefix, arrival
rates, text and token-id prompts (and how each is sent over HTTP), and sampling settings carried by
every workload YAML."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from engine.tokenizer import encode_prompt, load_tokenizer
from experiments.harness.random_dataset import length_range, random_dataset
from experiments.harness.workloads import special_token_ids, text_of_length, tokenize_requests
from experiments.http.client import HTTPTarget, request_payload

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
VOCAB, SPECIAL = 256, (0, 1, 2)


def test_exact_lengths_without_a_range_ratio() -> None:
    requests = random_dataset(VOCAB, SPECIAL, input_len=40, output_len=7, concurrency=3, prompt_format="token_ids")
    assert len(requests) == 12  # num_prompts=None: 4 x concurrency
    assert {len(r.prompt_token_ids) for r in requests} == {40}
    assert {r.sampling_params.max_tokens for r in requests} == {7}
    assert all(r.sampling_params.ignore_eos and not r.send_as_text for r in requests)
    assert not {t for r in requests for t in r.prompt_token_ids} & set(SPECIAL)


def test_range_ratio_spreads_lengths_over_vllms_range() -> None:
    assert length_range(100, 0.25, 1) == (75, 125) and length_range(3, 0.9, 1) == (1, 6)
    requests = random_dataset(VOCAB, SPECIAL, input_len=100, output_len=20, range_ratio=0.25, num_prompts=400,
                              prompt_format="token_ids")
    inputs = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.sampling_params.max_tokens for r in requests]
    assert min(inputs) >= 75 and max(inputs) <= 125 and len(set(inputs)) > 30
    assert min(outputs) >= 15 and max(outputs) <= 25 and len(set(outputs)) > 5


def test_every_prompt_starts_with_the_shared_prefix() -> None:
    requests = random_dataset(VOCAB, SPECIAL, input_len=10, prefix_len=32, num_prompts=5, prompt_format="token_ids")
    prefix = requests[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == prefix and len(r.prompt_token_ids) == 42 for r in requests)
    assert len({tuple(r.prompt_token_ids[32:]) for r in requests}) == 5  # the inputs after it differ


def test_all_at_once_or_gamma_arrivals_at_the_request_rate() -> None:
    assert {r.arrival_offset_s for r in random_dataset(VOCAB, SPECIAL, num_prompts=6)} == {0.0}
    requests = random_dataset(VOCAB, SPECIAL, input_len=4, output_len=2, num_prompts=2000, request_rate=5.0,
                              burstiness=0.5, prompt_format="token_ids")
    offsets = [r.arrival_offset_s for r in requests]
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert abs(gaps.mean() - 0.2) < 0.03                    # mean gap 1 / rate
    assert abs(gaps.var() / gaps.mean() ** 2 - 2.0) < 0.4   # gamma shape 0.5: squared coefficient of variation 1 / 0.5


def test_bad_fields_are_named() -> None:
    with pytest.raises(ValueError, match="prompt_format"):
        random_dataset(VOCAB, SPECIAL, prompt_format="bytes")
    with pytest.raises(ValueError, match="range_ratio"):
        random_dataset(VOCAB, SPECIAL, range_ratio=1.0)
    with pytest.raises(ValueError, match="num_prompts when workload.concurrency is null"):
        random_dataset(VOCAB, SPECIAL, concurrency=None)


def test_text_prompts_re_encode_to_the_drawn_length(byte_text_ckpt: Path) -> None:
    tokenizer = load_tokenizer(byte_text_ckpt)
    drawn = random_dataset(259, [256, 257, 258], input_len=64, output_len=4, num_prompts=20)
    assert all(r.send_as_text and not r.text for r in drawn)
    requests = tokenize_requests(drawn, tokenizer)
    for request in requests:
        assert request.text and request.prompt_text == request.text
        assert encode_prompt(tokenizer, request.text) == request.prompt_token_ids  # what a server tokenizes
    lengths = [len(r.prompt_token_ids) for r in requests]
    # raw random bytes are the worst case (a cut UTF-8 character decodes to U+FFFD, 3 bytes): near, mostly exact
    assert min(lengths) >= 64 and max(lengths) <= 67 and lengths.count(64) >= 10, lengths
    with pytest.raises(ValueError, match="prompt_format=token_ids"):
        tokenize_requests(drawn, None)


@pytest.mark.slow
def test_text_prompts_are_exact_with_the_real_tokenizer(real_ckpt: Path) -> None:
    tokenizer = load_tokenizer(real_ckpt)
    special = special_token_ids(None, tokenizer)
    for length in (128, 1024):
        requests = tokenize_requests(random_dataset(len(tokenizer), special, input_len=length, num_prompts=64), tokenizer)
        assert {len(r.prompt_token_ids) for r in requests} == {length}


def test_text_of_length_cuts_and_extends(byte_text_ckpt: Path) -> None:
    tokenizer = load_tokenizer(byte_text_ckpt)
    text, ids = text_of_length(tokenizer, list(b"plain ascii text"))
    assert text == "plain ascii text" and ids == list(b"plain ascii text")   # already exact: unchanged
    text, ids = text_of_length(tokenizer, [0xE2, 0x82, 0xAC, 0x41] * 8)      # whole UTF-8 characters
    assert len(ids) == 32 and encode_prompt(tokenizer, text) == ids


def test_text_prompts_travel_as_text_and_id_prompts_as_ids(byte_text_ckpt: Path) -> None:
    tokenizer = load_tokenizer(byte_text_ckpt)
    target = HTTPTarget("http://127.0.0.1:1/v1", "m")
    text = tokenize_requests(random_dataset(259, [256, 257, 258], num_prompts=1, temperature=1.0, top_p=0.9,
                                            top_k=20), tokenizer)[0]
    ids = random_dataset(259, [256, 257, 258], num_prompts=1, prompt_format="token_ids")[0]
    sent = request_payload(target, text)
    assert sent["prompt"] == text.text and isinstance(sent["prompt"], str)
    assert (sent["temperature"], sent["top_p"], sent["top_k"]) == (1.0, 0.9, 20)
    assert request_payload(target, ids)["prompt"] == ids.prompt_token_ids


@pytest.mark.parametrize("name", ["four_prompts", "burst", "poisson", "shared_prefix", "long_context", "chat", "random"])
def test_every_workload_yaml_takes_temperature_top_p_top_k(name: str) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"workload={name}", "model=tiny", "workload.temperature=0.7",
                                           "workload.top_p=0.8", "workload.top_k=5"])
    requests = instantiate(cfg.workload, vocab_size=VOCAB, special_token_ids=list(SPECIAL))
    assert requests and {(r.sampling_params.temperature, r.sampling_params.top_p, r.sampling_params.top_k)
                         for r in requests} == {(0.7, 0.8, 5)}
