"""``workload=sessions``: multi-turn conversations whose later turns carry the engine's own answers.

``num_users`` users each hold a ``turns``-turn conversation. Every user's first turn is sent at
t=0. Turn k is sent only when turn k-1 of the same user has come back, plus a think time (fixed,
or drawn from an exponential distribution with that mean; seeded, one draw per user and turn, so
the draws do not depend on which answer finishes first). The run therefore sends exactly
``num_users x turns`` requests (fewer only if a request fails: that user's conversation ends) and
stops by itself.

**The prompt of turn k is the conversation so far.** It is turn k-1's prompt, then the answer the
engine generated for it (its token ids, exactly as generated, a final stop token left out), then
the tokens that close the assistant's turn and open the user's next message:

* with a tokenizer and chat template, those tokens are what the template renders between the
  answer and the new assistant turn (the template renders the whole conversation, the answer's
  text as the assistant message; the part after ``earlier prompt + answer text`` is cut out and
  encoded), and each request also carries the conversation as chat ``messages`` (what the chat
  endpoint sends); a template that rewrites the answer (trims its whitespace) gets its own full
  rendering of the conversation instead (:meth:`Renderer.next_turn`);
* without a chat template (random-weight models have no tokenizer at all), a plain-text
  stand-in ``user: <message> assistant:``, encoded by the tokenizer or, without one, one stand-in
  token per word (:mod:`experiments.harness.text_tokens`).

So turn k-1's whole prompt and answer are an exact token prefix of turn k: a prefix cache
(``cache=prefix``) serves their full blocks, and the per-turn table shows it.

User messages are servelab's own: the first turn a question from the chat prompt bank
(:mod:`experiments.harness.chat_prompts`), later turns follow-ups from :data:`FOLLOW_UPS`, seeded.

Results: every turn is an ordinary request (``requests.csv``, named ``user-003-turn-02``), and
:meth:`Sessions.tables` adds ``turns``: one row per turn index with TTFT p50/p99 and the prompt
tokens served from the prefix cache (``turns.csv``, ``summary.json``'s ``turns``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.tokenizer import encode_chat, render_chat
from experiments.harness.chat_prompts import prompt_bank
from experiments.harness.follow_ups import Answer
from experiments.harness.metrics import distribution, ttft
from experiments.harness.records import RequestRecord
from experiments.harness.text_tokens import Encoder, text_encoder
from experiments.harness.workloads import WorkloadRequest, _params

#: what users say after the first answer (written for servelab)
FOLLOW_UPS = (
    "Can you say that more briefly?",
    "Give me one concrete example.",
    "Why is that?",
    "What would be a common mistake here?",
    "Explain the last point in more detail.",
    "How would you put that to a beginner?",
    "Is there anything you left out?",
    "Can you turn that into a short list?",
    "What is the most important part of your answer?",
    "Tell me more.",
    "How sure are you about that?",
    "What should I read next about this?",
)
THINK_TIME_DISTRIBUTIONS = ("fixed", "exponential")


def think_times(num_users: int, turns: int, mean_s: float, distribution_: str, seed: int) -> np.ndarray:
    """``[user, turn]`` seconds each user waits before sending that turn (column 0 unused: first
    turns go at t=0); ``fixed`` is ``mean_s`` everywhere, ``exponential`` seeded draws of that mean."""
    if distribution_ == "fixed" or mean_s == 0:
        return np.full((num_users, turns), float(mean_s))
    return np.random.default_rng([seed, 3]).exponential(mean_s, size=(num_users, turns))


def user_messages(num_users: int, turns: int, seed: int) -> list[list[str]]:
    """Every user's messages: a prompt-bank question, then follow-ups (each user's own seeded order)."""
    bank = prompt_bank()
    rng = np.random.default_rng([seed, 4])
    firsts = rng.choice(len(bank), size=num_users, replace=num_users > len(bank))
    said = []
    for first in firsts:
        order = rng.permutation(len(FOLLOW_UPS))
        said.append([bank[first], *(FOLLOW_UPS[order[k % len(order)]] for k in range(turns - 1))])
    return said


class Renderer:
    """Token ids of a conversation's first turn, and of what joins an answer to the next message
    (see the module docstring): the chat template's, or the plain-text stand-in's."""

    def __init__(self, tokenizer: Any | None, encode: Encoder, system_prompt: str | None) -> None:
        self.tokenizer = tokenizer
        self.encode = encode
        self.system = ({"role": "system", "content": system_prompt},) if system_prompt else ()
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def first(self, message: str) -> tuple[list[int], tuple[dict[str, str], ...]]:
        """The first turn's prompt and its conversation (empty without a chat template)."""
        if self.chat:
            messages = (*self.system, {"role": "user", "content": message})
            return encode_chat(self.tokenizer, messages), messages
        head = self.encode(f"system: {self.system[0]['content']}") if self.system else []
        return head + self._stand_in(message), ()

    def next_turn(self, prompt: list[int], answer_ids: list[int], messages: tuple[dict[str, str], ...],
                  answer_text: str, message: str) -> tuple[list[int], tuple[dict[str, str], ...]]:
        """The next turn's prompt (``prompt`` + ``answer_ids`` + the joint) and its conversation.

        A template that rewrites what it was given (one that trims an answer's whitespace, or
        changes earlier turns once more follow) cannot be extended token by token: the prompt is
        then its full rendering of the conversation, as a chat server would build it."""
        if not self.chat:
            return [*prompt, *answer_ids, *self._stand_in(message)], ()
        following = (*messages, {"role": "assistant", "content": answer_text}, {"role": "user", "content": message})
        head = render_chat(self.tokenizer, messages) + answer_text
        whole = render_chat(self.tokenizer, following)
        if not whole.startswith(head):
            return encode_chat(self.tokenizer, following), following
        return [*prompt, *answer_ids, *self.tokenizer.encode(whole[len(head):], add_special_tokens=False)], following

    def _stand_in(self, message: str) -> list[int]:
        return self.encode(f"user: {message} assistant:")

    def answer_ids(self, answer: Answer) -> list[int]:
        """The answer's token ids (encoded from its text when a server returned none)."""
        if answer.token_ids:
            return list(answer.token_ids)
        if self.tokenizer is None:
            raise ValueError("workload=sessions needs the generated token ids of every answer from a model without a "
                             "tokenizer: set engine.extra_body.return_token_ids=true")
        return list(self.tokenizer.encode(answer.text, add_special_tokens=False))


@dataclass
class Turn:
    """Where one request sits in the sessions."""

    user: int
    turn: int


@dataclass
class Sessions:
    """The :class:`~experiments.harness.follow_ups.FollowUps` of ``workload=sessions``."""

    messages: list[list[str]]
    think_s: np.ndarray
    params: Any
    renderer: Renderer
    special: frozenset[int]
    turns: int
    total_requests: int = 0
    placed: dict[str, Turn] = field(default_factory=dict)
    sent: list[WorkloadRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.total_requests = len(self.messages) * self.turns

    @staticmethod
    def name(user: int, turn: int) -> str:
        return f"user-{user:03d}-turn-{turn:02d}"

    def _issue(self, user: int, turn: int, prompt: list[int], messages: tuple[dict[str, str], ...],
               offset: float) -> WorkloadRequest:
        request = WorkloadRequest(self.name(user, turn), prompt, self.params, offset, messages=messages)
        self.placed[request.request_id] = Turn(user, turn)
        self.sent.append(request)
        return request

    def first_requests(self) -> list[WorkloadRequest]:
        """Every user's first turn, at t=0."""
        return [self._issue(user, 0, *self.renderer.first(said[0]), 0.0) for user, said in enumerate(self.messages)]

    def after(self, request: WorkloadRequest, answer: Answer) -> list[WorkloadRequest]:
        """The user's next turn: the conversation so far, this answer included, after the think time."""
        place = self.placed[request.request_id]
        nxt = place.turn + 1
        if nxt >= self.turns:
            return []
        answer_ids = self.renderer.answer_ids(answer)
        while answer_ids and answer_ids[-1] in self.special:  # the stop token: the template closes the turn itself
            answer_ids.pop()
        prompt, messages = self.renderer.next_turn(request.prompt_token_ids, answer_ids, request.messages, answer.text,
                                                   self.messages[place.user][nxt])
        return [self._issue(place.user, nxt, prompt, messages, answer.finish_s + float(self.think_s[place.user, nxt]))]

    def issued(self) -> list[WorkloadRequest]:
        return list(self.sent)

    def tables(self, records: Sequence[RequestRecord]) -> dict[str, list[dict[str, Any]]]:
        """``turns``: per turn index, its finished requests' TTFT and prefix-cache hits."""
        return {"turns": turn_table(records, {name: place.turn for name, place in self.placed.items()}, self.turns)}


def turn_table(records: Sequence[RequestRecord], turn_of: dict[str, int], turns: int) -> list[dict[str, Any]]:
    """One row per turn index (1-based ``turn``), also for turns no request reached: finished
    requests, TTFT mean / p50 / p99, mean prompt tokens, prompt tokens served from the prefix cache
    (mean and total) and their share of the turn's prompt tokens."""
    rows = []
    for turn in range(turns):
        done = [r for r in records if turn_of.get(r.request_id) == turn]
        prompt = sum(r.prompt_tokens for r in done)
        cached = sum(r.num_cached_tokens for r in done)
        ttfts = distribution(ttft(r) for r in done)
        rows.append({
            "turn": turn + 1, "requests": len(done),
            "ttft_s_mean": ttfts["mean"], "ttft_s_p50": ttfts["p50"], "ttft_s_p99": ttfts["p99"],
            "prompt_tokens_mean": prompt / len(done) if done else None,
            "cached_tokens_mean": cached / len(done) if done else None,
            "cached_tokens_total": cached,
            "cached_share": cached / prompt if prompt else None,
        })
    return rows


def sessions(
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    tokenizer: Any | None = None,
    seed: int = 0,
    num_users: int = 4,
    turns: int = 3,
    think_time_s: float = 1.0,
    think_time_distribution: str = "exponential",
    max_tokens: int = 32,
    system_prompt: str | None = None,
    ignore_eos: bool = False,
    temperature: float = 0.0,
) -> Sessions:
    """``num_users`` users x ``turns`` turns (see the module docstring); ``ValueError`` naming the field on bad input."""
    for name, value, low in (("num_users", num_users, 1), ("turns", turns, 1), ("max_tokens", max_tokens, 1)):
        if int(value) != value or value < low:
            raise ValueError(f"workload.{name} must be an integer >= {low}, got {value!r}")
    if not think_time_s >= 0:
        raise ValueError(f"workload.think_time_s must be >= 0 seconds, got {think_time_s!r}")
    if think_time_distribution not in THINK_TIME_DISTRIBUTIONS:
        raise ValueError(f"workload.think_time_distribution must be one of {THINK_TIME_DISTRIBUTIONS}, "
                         f"got {think_time_distribution!r}")
    renderer = Renderer(tokenizer, text_encoder(tokenizer, vocab_size, special_token_ids), system_prompt)
    return Sessions(
        messages=user_messages(num_users, turns, seed),
        think_s=think_times(num_users, turns, think_time_s, think_time_distribution, seed),
        params=_params(max_tokens, ignore_eos, temperature),
        renderer=renderer,
        special=frozenset(int(t) for t in special_token_ids),
        turns=turns,
    )
