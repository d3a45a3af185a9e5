"""The OpenAI-compatible server, through the official ``openai`` client against a live uvicorn on
127.0.0.1 (tiny random model, token-id prompts): shapes, streaming, usage, greedy parity with
in-process ``generate``, abort on disconnect, load, bad input, backpressure, faults."""
from __future__ import annotations

import asyncio
import threading

import httpx2 as httpx  # the HTTP client the openai package ships with
import openai
import pytest

from engine import LLM, SamplingParams
from server_harness import live_server, scrape, wait_until, wrap_forward

MODEL = "tiny"
PROMPTS = [[5, 6, 7], list(range(10, 40)), [300, 301], list(range(100, 117))]  # across a 16-token block boundary


def tiny_llm(**options) -> LLM:
    return LLM(model=MODEL, device="cpu", **options)


def client(base_url: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=options.pop("api_key", "unused"), max_retries=0,
                         timeout=30, **options)


def greedy(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    """In-process greedy tokens for PROMPTS (24 tokens each)."""
    outputs = tiny_llm().generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    return {tuple(p): o.token_ids for p, o in zip(PROMPTS, outputs)}


def streamed_tokens(stream) -> tuple[list[int], list, object]:
    """(token ids, chunks with choices, usage) of a completions stream."""
    tokens, chunks, usage = [], [], None
    for chunk in stream:
        if chunk.choices:
            chunks.append(chunk)
            tokens += chunk.choices[0].token_ids
        if chunk.usage is not None:
            usage = chunk.usage
    return tokens, chunks, usage


def test_completions_match_in_process_generate(reference) -> None:
    with live_server(tiny_llm()) as url:
        api = client(url)
        assert [m.id for m in api.models.list().data] == [MODEL]
        for prompt, expected in reference.items():
            whole = api.completions.create(model=MODEL, prompt=list(prompt), **greedy(24))
            assert whole.choices[0].token_ids == expected
            assert whole.choices[0].finish_reason == "length"
            assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), 24)

            stream = api.completions.create(model=MODEL, prompt=list(prompt), stream=True,
                                            stream_options={"include_usage": True}, **greedy(24))
            tokens, chunks, usage = streamed_tokens(stream)
            assert tokens == expected
            assert len(chunks) == 24  # one chunk per token
            assert [c.choices[0].finish_reason for c in chunks] == [None] * 23 + ["length"]
            assert usage.completion_tokens == 24 and usage.prompt_tokens == len(prompt)
            assert usage.prompt_tokens_details.cached_tokens == 0


def test_usage_reports_prefix_cache_hits() -> None:
    prompt = list(range(20, 60))  # 40 tokens: 2 full 16-token blocks can be shared
    with live_server(tiny_llm(cache="prefix")) as url:
        api = client(url)
        cached = []
        for _ in range(2):
            stream = api.completions.create(model=MODEL, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **greedy(4))
            cached.append(streamed_tokens(stream)[2].prompt_tokens_details.cached_tokens)
        assert cached == [0, 32]
        metrics = scrape(url)
        assert metrics["vllm:prefix_cache_hits_total"] == 32
        assert metrics["vllm:prefix_cache_queries_total"] == 80


def test_seeded_sampling_over_http_matches_in_process() -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, min_p=0.05, seed=7, ignore_eos=True)
    expected = tiny_llm().generate([PROMPTS[1]], params)[0].token_ids
    with live_server(tiny_llm()) as url:
        got = client(url).completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
            extra_body={"top_k": 50, "min_p": 0.05, "ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].token_ids == expected


def test_disconnect_aborts_and_frees_memory_others_unaffected(reference) -> None:
    llm = tiny_llm()
    wrap_forward(llm, lambda: threading.Event().wait(0.004))  # ~4 ms steps: the long request outlives the test
    with live_server(llm) as url:
        api = client(url)
        results: dict[int, list[int]] = {}

        def finish(index: int, prompt: list[int]) -> None:
            stream = api.completions.create(model=MODEL, prompt=prompt, stream=True, **greedy(24))
            results[index] = streamed_tokens(stream)[0]

        others = [threading.Thread(target=finish, args=(i, p)) for i, p in enumerate(PROMPTS[:2])]
        doomed = api.completions.create(model=MODEL, prompt=PROMPTS[3], stream=True, **greedy(480))
        for thread in others:
            thread.start()
        for _, _chunk in zip(range(3), doomed):
            pass
        doomed.close()  # the client goes away after 3 chunks
        assert wait_until(lambda: scrape(url).get("vllm:request_success_total{finished_reason=abort}") == 1, 2.0)
        for thread in others:
            thread.join(30)
        assert results == {0: reference[tuple(PROMPTS[0])], 1: reference[tuple(PROMPTS[1])]}
        assert wait_until(lambda: scrape(url)["vllm:num_requests_running"] == 0
                          and scrape(url)["vllm:kv_cache_usage_perc"] == 0.0, 2.0)
        assert scrape(url)["vllm:request_success_total{finished_reason=length}"] == 2
    llm.free_blocks_check()


def test_non_streaming_disconnect_aborts() -> None:
    llm = tiny_llm()
    wrap_forward(llm, lambda: threading.Event().wait(0.004))
    with live_server(llm) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", timeout=0.5,
                       json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True})
        assert wait_until(lambda: scrape(url).get("vllm:request_success_total{finished_reason=abort}") == 1, 2.0)
        assert wait_until(lambda: scrape(url)["vllm:kv_cache_usage_perc"] == 0.0, 2.0)


def test_load_64_clients_x_4_requests_each_answered_once() -> None:
    llm = tiny_llm()
    clients, per_client = 64, 4

    async def one_client(api: openai.AsyncOpenAI, index: int) -> list[tuple[str, int, int, int]]:
        answers = []
        for k in range(per_client):
            max_tokens = 1 + (index * per_client + k) % 17
            stream = await api.completions.create(
                model=MODEL, prompt=[10 + index, 20 + k, 30], stream=True, stream_options={"include_usage": True},
                **greedy(max_tokens))
            ids, tokens, usage = set(), 0, None
            async for chunk in stream:
                ids.add(chunk.id)
                if chunk.choices:
                    tokens += len(chunk.choices[0].token_ids)
                usage = chunk.usage or usage
            assert len(ids) == 1
            answers.append((ids.pop(), max_tokens, tokens, usage.completion_tokens))
        return answers

    async def load(url: str) -> list[tuple[str, int, int, int]]:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        answers = await asyncio.gather(*(one_client(api, i) for i in range(clients)))
        await api.close()
        return [a for per in answers for a in per]

    with live_server(llm) as url:
        answers = asyncio.run(load(url))
        metrics = scrape(url)
    assert len(answers) == clients * per_client
    assert len({response_id for response_id, *_ in answers}) == clients * per_client  # each answered once
    assert all(asked == streamed == counted for _, asked, streamed, counted in answers)
    assert metrics["vllm:request_success_total{finished_reason=length}"] == clients * per_client
    assert metrics["vllm:generation_tokens_total"] == sum(asked for _, asked, _, _ in answers)
    llm.free_blocks_check()  # the pool is full again


BAD_REQUESTS = [  # (body, param, words the message must contain)
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": 0}, "max_tokens", ["greater than or equal to 1"]),
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": "5"}, "max_tokens", ["integer"]),
    ({"model": MODEL, "prompt": [1, 2], "temperature": "hot"}, "temperature", ["number"]),
    ({"model": MODEL, "prompt": [1, 2], "n": 2}, "n", ["n must be 1"]),
    ({"model": MODEL, "prompt": [1, 2], "min_p": 1.5}, "min_p", ["less than or equal to 1"]),
    ({"model": MODEL, "prompt": [1, 2], "priority": 0.5}, "priority", ["integer"]),
    ({"model": "gpt-4", "prompt": [1, 2]}, "model", ["'gpt-4'", "'tiny'"]),
    ({"model": MODEL, "prompt": [1] * 600, "max_tokens": 4}, "prompt", ["600", "512"]),
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": 511}, "max_tokens", ["513", "512"]),
    ({"model": MODEL, "prompt": [1, 9999]}, "prompt", ["9999", "512"]),
    ({"model": MODEL, "prompt": "text on a model without a tokenizer"}, "prompt", ["tokenizer"]),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "prompt", None),  # wrong endpoint body
]


def test_bad_requests_get_400_with_openai_error_and_server_keeps_serving(reference) -> None:
    with live_server(tiny_llm()) as url:
        for body, param, words in BAD_REQUESTS:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
            assert response.status_code == 400, body
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["param"] == param, (body, error)
            assert all(word in error["message"] for word in words or []), error
        malformed = httpx.post(f"{url}/v1/completions", content=b'{"model": "tiny",', timeout=10,
                               headers={"content-type": "application/json"})
        assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
        chat = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=10)
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        with pytest.raises(openai.BadRequestError):
            client(url).completions.create(model=MODEL, prompt=[1, 2], n=3)
        good = client(url).completions.create(model=MODEL, prompt=PROMPTS[0], **greedy(24))
        assert good.choices[0].token_ids == reference[tuple(PROMPTS[0])]


def test_api_key_guards_v1_only() -> None:
    with live_server(tiny_llm(), api_key="sesame") as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1]}, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="wrong").models.list()
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        answer = client(url, api_key="sesame").completions.create(model=MODEL, prompt=[1, 2], **greedy(3))
        assert len(answer.choices[0].token_ids) == 3


def test_more_than_max_waiting_gets_503_and_nothing_is_queued() -> None:
    llm = tiny_llm()
    gate = threading.Event()
    wrap_forward(llm, lambda: gate.wait(30))  # the engine holds in its first forward pass
    with live_server(llm, max_waiting=2) as url:
        api = client(url)
        waiting = [api.completions.create(model=MODEL, prompt=p, stream=True, **greedy(3)) for p in PROMPTS[:2]]
        busy = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPTS[2]}, timeout=10)
        assert busy.status_code == 503
        assert busy.headers["retry-after"] == "1"
        assert "max_waiting=2" in busy.json()["error"]["message"]
        gate.set()
        assert [len(streamed_tokens(stream)[0]) for stream in waiting] == [3, 3]
        good = api.completions.create(model=MODEL, prompt=PROMPTS[2], **greedy(3))
        assert len(good.choices[0].token_ids) == 3
        assert scrape(url)["vllm:request_success_total{finished_reason=length}"] == 3  # the 503 never ran


def test_failing_step_ends_streams_with_error_and_server_keeps_serving(reference) -> None:
    llm = tiny_llm()
    failures = iter([RuntimeError("injected forward failure")])

    def fail_once() -> None:
        error = next(failures, None)
        if error is not None:
            raise error

    wrap_forward(llm, fail_once)
    with live_server(llm) as url:
        api = client(url)
        stream = api.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **greedy(8))
        with pytest.raises(openai.APIError, match="injected forward failure"):
            streamed_tokens(stream)
        good = api.completions.create(model=MODEL, prompt=PROMPTS[0], **greedy(24))
        assert good.choices[0].token_ids == reference[tuple(PROMPTS[0])]
        assert httpx.get(f"{url}/health").status_code == 200
        assert scrape(url)["vllm:request_success_total{finished_reason=error}"] == 1


def test_dead_engine_thread_fails_streams_and_health() -> None:
    llm = tiny_llm()

    def broken_schedule():
        raise RuntimeError("scheduler bug")

    with live_server(llm) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        llm.scheduler.schedule = broken_schedule
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2},
                              timeout=10)
        assert response.status_code == 503 and "scheduler bug" in response.json()["error"]["message"]
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, 2.0)
        again = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1, 2]}, timeout=10)
        assert again.status_code == 503
