"""workload=sessions: turn k's prompt is turn k-1's prompt plus the engine's own answer, turns of one
user run one after another with the think time between them, the prefix cache serves the earlier
turns, the per-turn table has a row per turn, and bad settings name their field. In-process on tiny
models (token-id stand-in and a byte tokenizer with a chat template), over HTTP through servelab's
server, and end to end through the harness on the simulator."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from engine import LLM
from engine.tokenizer import encode_chat
from engines import build_engine
from experiments.harness.driver import drive
from experiments.harness.follow_ups import Answer
from experiments.harness.records import RequestRecord
from experiments.harness.sessions import Sessions, sessions
from experiments.harness.workloads import WorkloadRequest, special_token_ids
from experiments.http.client import HTTPTarget, drive_result, run_load
from harness_runs import SIMULATED_TINY, run_once
from server_harness import live_server

FAST_START = {"prepack": False, "fused_ops": False}
USERS, TURNS = 3, 3


def small_engine(ckpt: Path, cache: str) -> LLM:
    return build_engine(ckpt, cache, "continuous", cache_options={"block_size": 4, "capacity_tokens": 4096}, **FAST_START)


def tiny_sessions(engine: LLM, **options) -> Sessions:
    settings = dict(num_users=USERS, turns=TURNS, think_time_s=0.0, max_tokens=6, ignore_eos=True) | options
    return sessions(engine.model_config.vocab_size, special_token_ids(engine.model_config, engine.tokenizer),
                    engine.tokenizer, **settings)


def by_turn(records: Sequence[RequestRecord], workload: Sessions) -> dict[tuple[int, int], RequestRecord]:
    return {(workload.placed[r.request_id].user, workload.placed[r.request_id].turn): r for r in records}


def run_in_process(engine: LLM, workload: Sessions) -> tuple[dict[tuple[int, int], RequestRecord], dict[str, WorkloadRequest]]:
    result = drive(engine, workload.first_requests(), progress=False, follow_ups=workload)
    assert len(result.records) == USERS * TURNS
    return by_turn(result.records, workload), {r.request_id: r for r in workload.issued()}


def assert_answers_carried(records: dict[tuple[int, int], RequestRecord], requests: dict[str, WorkloadRequest],
                           special: set[int]) -> None:
    """Turn k's prompt starts with turn k-1's prompt followed by turn k-1's generated ids (its stop token left out)."""
    for (user, turn), record in records.items():
        if turn == 0:
            continue
        earlier = records[(user, turn - 1)]
        before = requests[earlier.request_id].prompt_token_ids
        answer = list(earlier.output_token_ids)
        while answer and answer[-1] in special:
            answer.pop()
        assert answer, "the earlier answer has tokens to carry"
        prompt = requests[record.request_id].prompt_token_ids
        assert prompt[: len(before) + len(answer)] == before + answer, (user, turn)
        assert len(prompt) > len(before) + len(answer)  # the next message follows
        assert record.prompt_tokens == len(prompt)


def test_turn_prompt_carries_previous_prompt_and_answer(tiny_llama_ckpt):
    """Token-id stand-in (no tokenizer): the next prompt is the earlier prompt + the generated ids + the next message."""
    engine = small_engine(tiny_llama_ckpt, "prefix")
    workload = tiny_sessions(engine)
    records, requests = run_in_process(engine, workload)
    assert_answers_carried(records, requests, set(workload.special))


def test_chat_template_turn_carries_answer_ids_and_text(byte_text_ckpt):
    """With a chat template the answer's ids are spliced in and its text is the assistant message."""
    engine = LLM(model=str(byte_text_ckpt), device="cpu", capacity_tokens=4096, block_size=4, **FAST_START)
    workload = tiny_sessions(engine, ignore_eos=False, max_tokens=8)
    records, requests = run_in_process(engine, workload)
    assert_answers_carried(records, requests, set(workload.special))
    for (user, turn), record in records.items():
        messages = requests[record.request_id].messages
        assert [m["role"] for m in messages] == ["user", "assistant"] * turn + ["user"]
        if turn:
            assert messages[-2]["content"] == records[(user, turn - 1)].output_text


def test_template_that_trims_answers_gets_its_full_rendering():
    """A template that rewrites the answer (trims it) cannot be extended token by token: the prompt is its
    full rendering of the conversation; one that keeps the answer as given is extended by the answer's ids."""
    from conftest import BYTE_CHAT_TEMPLATE, byte_tokenizer

    answer_text = " the answer \n"
    for template, spliced in ((BYTE_CHAT_TEMPLATE.replace("m['content'] }}", "m['content'] | trim }}"), False),
                              (BYTE_CHAT_TEMPLATE, True)):
        tokenizer = byte_tokenizer()
        tokenizer.chat_template = template
        workload = sessions(259, [256, 257, 258], tokenizer, num_users=1, turns=2)
        first = workload.first_requests()[0]
        answer_ids = tokenizer.encode(answer_text, add_special_tokens=False)
        (second,) = workload.after(first, Answer(answer_ids, answer_text, 1.0))
        assert second.prompt_token_ids == encode_chat(tokenizer, second.messages)
        carried = first.prompt_token_ids + answer_ids
        assert (second.prompt_token_ids[: len(carried)] == carried) == spliced


def test_turns_of_one_user_never_overlap_and_wait_the_think_time(tiny_llama_ckpt):
    """Turn k is sent no earlier than turn k-1's finish plus that user's think time (a seeded exponential draw)."""
    engine = small_engine(tiny_llama_ckpt, "paged")
    workload = tiny_sessions(engine, think_time_s=0.02, think_time_distribution="exponential")
    records, _ = run_in_process(engine, workload)
    assert len({float(workload.think_s[u, k]) for u in range(USERS) for k in range(1, TURNS)}) > 1  # drawn, not fixed
    for (user, turn), record in records.items():
        assert record.submit_s <= record.first_token_s <= record.finish_s
        if turn:
            earlier = records[(user, turn - 1)]
            assert record.submit_s >= earlier.finish_s + workload.think_s[user, turn] - 1e-9, (user, turn)


@pytest.mark.parametrize("cache", ["prefix", "paged"])
def test_later_turns_hit_the_prefix_cache_only_with_it(tiny_llama_ckpt, cache):
    """cache=prefix serves turn k-1's prompt and answer to turn k (hit tokens > 0 for every later turn); paged never hits."""
    engine = small_engine(tiny_llama_ckpt, cache)
    workload = tiny_sessions(engine)
    records, _ = run_in_process(engine, workload)
    table = workload.tables(list(records.values()))["turns"]
    assert [row["turn"] for row in table] == list(range(1, TURNS + 1))
    for (user, turn), record in records.items():
        if cache == "prefix" and turn > 0:
            assert record.num_cached_tokens > 0, (user, turn)
        else:
            assert record.num_cached_tokens == 0, (user, turn)
    assert (table[-1]["cached_tokens_total"] > 0) == (cache == "prefix")


def test_sessions_over_http_carry_answers_and_hit_the_cache(tiny_llama_ckpt):
    """Through servelab's HTTP server: follow-ups use the returned token ids, and the server reports prefix hits."""
    engine = small_engine(tiny_llama_ckpt, "prefix")
    workload = tiny_sessions(engine, think_time_s=0.01, think_time_distribution="fixed")
    with live_server(engine) as url:
        target = HTTPTarget(f"{url}/v1", "tiny", timeout_s=60, extra_body={"return_token_ids": True})
        run = asyncio.run(run_load(target, workload.first_requests(), None, progress=False, follow_ups=workload))
    result = drive_result(run)
    assert not result.failures and len(result.records) == USERS * TURNS
    records = by_turn(result.records, workload)
    assert_answers_carried(records, {r.request_id: r for r in workload.issued()}, set(workload.special))
    for (user, turn), record in records.items():
        if turn:
            assert record.num_cached_tokens > 0, (user, turn)
            assert record.submit_s >= records[(user, turn - 1)].finish_s + 0.01 - 1e-9, (user, turn)


def test_run_writes_one_turn_row_per_turn(tmp_path):
    """python run.py workload=sessions on the simulator: U x T requests, and turns.csv / summary.json have T rows."""
    overrides = [*SIMULATED_TINY, "workload=sessions", "cache=prefix", "workload.num_users=2", "workload.turns=4",
                 "workload.max_tokens=8", "workload.think_time_s=0.5"]
    outcome = run_once(overrides, tmp_path)
    assert outcome.summary["status"] == "ok", outcome.summary.get("error")
    assert outcome.summary["metrics"]["num_requests"] == 2 * 4
    turns = outcome.summary["turns"]
    assert [row["turn"] for row in turns] == [1, 2, 3, 4] and all(row["requests"] == 2 for row in turns)
    assert all(row["ttft_s_p50"] is not None and row["ttft_s_p99"] >= row["ttft_s_p50"] for row in turns)
    assert (tmp_path / "turns.csv").read_text().count("\n") == 1 + 4
    assert (tmp_path / "turns.md").is_file()


@pytest.mark.parametrize("field, value", [
    ("num_users", 0), ("turns", 0), ("think_time_s", -1.0), ("max_tokens", 0), ("think_time_distribution", "gamma"),
])
def test_bad_settings_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"workload.{field}"):
        sessions(256, [1, 2], None, **{field: value})
