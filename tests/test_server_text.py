"""Text through the server: text prompts, chat through the chat template, stop strings, streamed
text deltas; equal to in-process ``generate`` / ``chat``. Fast suite: a tiny random model with a
byte-level tokenizer (conftest.byte_text_ckpt); slow: the real SmolLM2-135M-Instruct."""
from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from server_harness import live_server

NAME = "byte"
QUESTION = [{"role": "user", "content": "Say something."}]


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(max_tokens: int, **extra) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True, **extra}}


def test_text_prompt_stream_and_stop_strings_match_in_process(byte_text_ckpt) -> None:
    reference = LLM(model=str(byte_text_ckpt), device="cpu")
    prompt = "The cat sat on the"
    plain = reference.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    stop = next(plain.text[i:i + 2] for i in range(6, len(plain.text)) if plain.text[i:i + 2].isprintable())
    stopped = reference.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)))[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    with live_server(LLM(model=str(byte_text_ckpt), device="cpu"), NAME) as url:
        whole = api(url).completions.create(model=NAME, prompt=prompt, **greedy(40))
        assert whole.choices[0].text == plain.text
        assert whole.choices[0].token_ids == plain.token_ids
        chunks = list(api(url).completions.create(model=NAME, prompt=prompt, stream=True, **greedy(40)))
        assert "".join(c.choices[0].text for c in chunks) == plain.text
        cut = api(url).completions.create(model=NAME, prompt=prompt, stop=[stop], **greedy(40))
        assert (cut.choices[0].text, cut.choices[0].finish_reason) == (stopped.text, "stop")
        cut_chunks = list(api(url).completions.create(model=NAME, prompt=prompt, stop=stop, stream=True, **greedy(40)))
        assert "".join(c.choices[0].text for c in cut_chunks) == stopped.text
        assert cut_chunks[-1].choices[0].finish_reason == "stop"


def test_chat_first_chunk_carries_role_and_first_token(byte_text_ckpt) -> None:
    expected = LLM(model=str(byte_text_ckpt), device="cpu").chat(QUESTION, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    with live_server(LLM(model=str(byte_text_ckpt), device="cpu"), NAME) as url:
        whole = api(url).chat.completions.create(model=NAME, messages=QUESTION, **greedy(12))
        assert whole.choices[0].message.role == "assistant"
        assert whole.choices[0].message.content == expected.text
        assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)
        stream = api(url).chat.completions.create(model=NAME, messages=QUESTION, stream=True,
                                                  stream_options={"include_usage": True}, **greedy(12))
        chunks = list(stream)
        with_choices = [c for c in chunks if c.choices]
        assert with_choices[0].choices[0].delta.role == "assistant"
        assert with_choices[0].choices[0].token_ids == expected.token_ids[:1]  # the role comes with the first token
        assert all(c.choices[0].delta.role is None for c in with_choices[1:])
        assert "".join(c.choices[0].delta.content for c in with_choices) == expected.text
        assert len(with_choices) == 12 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


@pytest.mark.slow  # loads the real SmolLM2-135M-Instruct (GGUF conversion on a fresh cache: ~10 s, then ~1 s per answer)
def test_real_model_answers_chat_over_http() -> None:
    with live_server(LLM(model="smollm2-135m-instruct", device="cpu"), "smollm2-135m-instruct") as url:
        answer = api(url).chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20, temperature=0.0)
        text = "".join(c.choices[0].delta.content or "" for c in api(url).chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20, temperature=0.0, stream=True))
    assert answer.choices[0].message.content == "The capital of France is Paris." == text
    assert answer.choices[0].finish_reason == "stop"
