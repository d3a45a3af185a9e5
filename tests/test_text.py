"""Text in, text out on the fast suite: a tiny random Llama whose vocabulary is bytes (conftest's
``byte_text_ckpt``), so every non-ASCII character spans several tokens.

Covers incremental detokenization (equal to a full decode at every prefix), streamed text that
only grows, stop strings, stop token ids, EOS (from config.json and generation_config.json),
``ignore_eos``, text and chat prompts, and their validation.
"""
from __future__ import annotations

import json
import random
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from engine.stop_strings import find_stop_string, visible_text
from engine.tokenizer import decode, load_tokenizer


def incremental_matches_full_decode(tokenizer, prompt: list[int], output: list[int]) -> None:
    """After every token, the incremental text equals a full decode of the output so far — or,
    while that decode ends in an incomplete character (U+FFFD), the full decode at the last token
    where it did not: the held-back token's text is released whole once its bytes complete."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    last_complete = ""
    for k, token in enumerate(output, start=1):
        detokenizer.append(token)
        full = decode(tokenizer, output[:k])
        if not full.endswith(REPLACEMENT_CHAR):
            last_complete = full
        assert detokenizer.text == last_complete, (k, output[:k])
    detokenizer.flush()  # the request finished: everything is released
    assert detokenizer.text == decode(tokenizer, output)


TEXTS = ["héllo wörld", "東京は日本の首都です。", "emoji 🙂👍🏽 and flags 🇫🇷!", "mixed: café, 世界, 😀, done."]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_multibyte(byte_text_ckpt, text):
    llm_tokenizer = load_tokenizer(byte_text_ckpt)
    ids = llm_tokenizer.encode(text)
    assert len(ids) > len(text)  # multi-byte characters really are split across tokens
    for prompt in ([], llm_tokenizer.encode("context: ")):
        incremental_matches_full_decode(llm_tokenizer, prompt, ids)
    detokenizer = IncrementalDetokenizer(llm_tokenizer, [])
    for token in ids:
        detokenizer.append(token)
    assert detokenizer.text == text


def test_incremental_detokenization_random_bytes(byte_text_ckpt):
    """Invalid and truncated UTF-8 too (random bytes, special tokens in between)."""
    tokenizer = load_tokenizer(byte_text_ckpt)
    rng = random.Random(0)
    for _ in range(20):
        output = [rng.choice([rng.randrange(256), rng.randrange(0xC0, 0x100), 256, 257]) for _ in range(40)]
        incremental_matches_full_decode(tokenizer, tokenizer.encode("ask: "), output)


def test_stop_string_search_and_hold_back():
    assert find_stop_string("hello world", 2, ["wor"]) is None  # "wor" ended before the 2 new chars "ld"
    assert find_stop_string("hello world", 3, ["wor"]) == 6
    assert find_stop_string("abXYcd", 2, ["XYc", "Yc"]) == 2  # the earliest start wins
    assert visible_text("hello wo", ["world"], finished=False) == "hell"
    assert visible_text("hello wo", ["world"], finished=True) == "hello wo"
    assert visible_text("hi", ["world"], finished=False) == ""


@pytest.fixture(scope="module")
def byte_llm(byte_text_ckpt) -> LLM:
    return LLM(model=str(byte_text_ckpt), device="cpu", capacity_tokens=512, block_size=4)


PROMPT = "Hello there, "


@pytest.fixture(scope="module")
def free_run(byte_llm):
    """The greedy continuation of PROMPT with EOS ignored (what the stopping tests cut)."""
    out = byte_llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    return out


def test_text_prompt_equals_token_prompt(byte_llm, free_run):
    ids = byte_llm.tokenizer.encode(PROMPT)
    by_ids = byte_llm.generate([ids], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert free_run.prompt_token_ids == ids and by_ids.token_ids == free_run.token_ids
    assert free_run.text == decode(byte_llm.tokenizer, free_run.token_ids)  # finished: the full decode


def test_stop_string_ends_request_and_is_cut(byte_llm, free_run):
    text = free_run.text
    candidates = [i for i in range(3, len(text) - 2) if REPLACEMENT_CHAR not in text[i:i + 2]]
    assert candidates, f"no usable stop string in {text!r}"
    start = candidates[len(candidates) // 2]
    stop = text[start:start + 2]
    cut = text.index(stop)
    out = byte_llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop, "never-there"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert out.token_ids == free_run.token_ids[: len(out.token_ids)] and len(out.token_ids) < 40


def test_stop_token_ids_end_request(byte_llm, free_run):
    token = free_run.token_ids[10]
    first = free_run.token_ids.index(token)
    out = byte_llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[token]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run.token_ids[: first + 1]


def test_eos_ends_request_unless_ignored(tmp_path, byte_text_ckpt, free_run):
    """EOS named by generation_config.json (the instruct model's <|im_end|> case) ends the request;
    ``ignore_eos`` runs on to max_tokens."""
    folder = tmp_path / "ckpt"
    shutil.copytree(byte_text_ckpt, folder)
    eos = free_run.token_ids[12]
    first = free_run.token_ids.index(eos)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    llm = LLM(model=str(folder), device="cpu", capacity_tokens=512, block_size=4)
    assert eos in llm.model_config.eos_token_ids
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=40))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free_run.token_ids[: first + 1]
    ignored = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == free_run.token_ids


def test_streamed_text_only_grows(byte_llm, free_run):
    """step() reports unfinished requests too: their text is always a prefix of the next one's,
    also with a stop string pending (its possible beginning is held back)."""
    text = free_run.text
    start = next(i for i in range(10, len(text) - 3) if REPLACEMENT_CHAR not in text[i:i + 3])
    stop = text[start:start + 3]  # complete characters, arriving one per step: its beginning must be held back
    for params in (SamplingParams(max_tokens=40, ignore_eos=True),
                   SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])):
        request_id = byte_llm.add_request(PROMPT, params)
        texts, finished = [], None
        for _ in range(100):
            for output in byte_llm.step():
                if output.request_id == request_id:
                    texts.append(output.text)
                    finished = output if output.finished else None
            if finished:
                break
        assert finished is not None and len(texts) == len(finished.token_ids)
        for before, after in zip(texts, texts[1:]):
            assert after.startswith(before), (before, after)
        assert texts[-1] == finished.text
        if params.stop:
            assert finished.finish_reason == "stop" and finished.text == text[: text.index(stop)]


def test_chat_applies_template(byte_llm):
    messages = [{"role": "user", "content": "Hi 👋"}]
    out = byte_llm.chat(messages, SamplingParams(max_tokens=5, ignore_eos=True))[0]
    rendered = "<s>user: Hi 👋\n<s>assistant: "
    assert out.prompt_token_ids == byte_llm.tokenizer.encode(rendered, add_special_tokens=False)
    both = byte_llm.chat([messages, [{"role": "user", "content": "Yo"}]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(both) == 2 and both[0].token_ids == out.token_ids
    with pytest.raises(ValueError, match="'role' and 'content'"):
        byte_llm.chat([{"content": "no role"}])


def test_text_prompt_limits_are_counted_in_tokens(byte_llm):
    limit = byte_llm.model_config.max_model_len  # 256 tokens; every byte is one token
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        byte_llm.generate("é" * (limit // 2), SamplingParams(max_tokens=1))  # 128 characters, 256 tokens
    with pytest.raises(ValueError, match="prompt is empty"):
        byte_llm.generate("", SamplingParams(max_tokens=1))
    assert byte_llm.generate("ok", SamplingParams(max_tokens=1))[0].finished  # the engine keeps serving


def test_no_tokenizer_text_requests_are_rejected(tiny_llama_ckpt):
    llm = LLM(model=str(tiny_llama_ckpt), device="cpu", capacity_tokens=256)
    assert llm.tokenizer is None
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0].text == ""
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_sampling_params_stop_normalised():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop == ("a", "b")
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=[""])
