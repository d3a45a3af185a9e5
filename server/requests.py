"""From an OpenAI request body to what the engine takes: prompt token ids and ``SamplingParams``.

Everything that can be checked before the request is queued is checked here, on the event loop,
so a bad request gets a 400 naming the field and the limit and never reaches the engine:
the model name, ``n``, batched prompts, ids outside the vocabulary, text or chat or stop strings
on a model without a tokenizer, and prompt + ``max_tokens`` against the model's context and the
KV budget. The limits are a snapshot taken at startup (:class:`ModelLimits`): the engine thread
owns the engine, handlers only read this copy (and the tokenizer, which is read-only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_chat, encode_prompt
from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, bad_request


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against.

    Attributes:
        served_model_name: the name clients must send as ``model``.
        vocab_size: token ids must be in ``[0, vocab_size)``.
        max_model_len: the model's longest context (prompt + generated tokens).
        max_tokens_per_seq: the longest sequence the KV cache could ever hold.
        tokenizer: the model's HF tokenizer, or ``None`` (token-id prompts only).
    """

    served_model_name: str
    vocab_size: int
    max_model_len: int
    max_tokens_per_seq: int
    tokenizer: Any | None

    @classmethod
    def of(cls, llm: Any, served_model_name: str) -> "ModelLimits":
        return cls(served_model_name, llm.model_config.vocab_size, llm.model_config.max_model_len,
                   llm.cache.max_tokens_per_seq(), getattr(llm, "tokenizer", None))

    @property
    def max_context(self) -> int:
        return min(self.max_model_len, self.max_tokens_per_seq)


@dataclass(frozen=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams


def _require_tokenizer(limits: ModelLimits, what: str, param: str) -> Any:
    if limits.tokenizer is None:
        raise bad_request(f"{what} needs a tokenizer and model {limits.served_model_name!r} has none: "
                          f"send the prompt as token ids to /v1/completions", param)
    return limits.tokenizer


def completion_prompt_ids(body: CompletionRequest, limits: ModelLimits) -> list[int]:
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"batched prompts are not supported: got {len(prompt)} prompts, send one per request",
                              "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode_prompt(_require_tokenizer(limits, "a text prompt", "prompt"), prompt)
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise bad_request(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})", "prompt")
    return list(prompt)


def chat_prompt_ids(body: ChatCompletionRequest, limits: ModelLimits) -> list[int]:
    tokenizer = _require_tokenizer(limits, "chat", "messages")
    for i, message in enumerate(body.messages):
        if not isinstance(message.content, str) and any(part.type != "text" for part in message.content):
            raise bad_request(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
    try:
        return encode_chat(tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages])
    except ValueError as error:
        raise bad_request(str(error), "messages") from error


def sampling_params(body: SamplingFields, prompt_len: int, limits: ModelLimits, requested_max: int | None,
                    prompt_param: str) -> SamplingParams:
    """``SamplingParams`` for a checked request. Without ``max_tokens`` the answer may fill the context."""
    if body.n != 1:
        raise bad_request(f"n={body.n} is not supported: this server returns exactly one choice (n must be 1)", "n")
    if not prompt_len:
        raise bad_request("the prompt is empty: a request needs at least 1 prompt token", prompt_param)
    if prompt_len >= limits.max_context:
        raise bad_request(
            f"the prompt has {prompt_len} tokens; this model's limit is {limits.max_context} tokens "
            f"(max_model_len={limits.max_model_len}, KV budget per sequence={limits.max_tokens_per_seq}) "
            f"for prompt + generated tokens", prompt_param, code="context_length_exceeded")
    max_tokens = requested_max if requested_max is not None else limits.max_context - prompt_len
    if prompt_len + max_tokens > limits.max_context:
        raise bad_request(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} exceeds this "
            f"model's limit of {limits.max_context} tokens (max_model_len={limits.max_model_len}, "
            f"KV budget per sequence={limits.max_tokens_per_seq})", "max_tokens", code="context_length_exceeded")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if stop:
        _require_tokenizer(limits, "stop strings", "stop")
        if not all(stop):
            raise bad_request("stop strings must not be empty", "stop")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, min_p=body.min_p, priority=body.priority, seed=body.seed,
                              ignore_eos=body.ignore_eos, stop=stop)
    except ValueError as error:
        raise bad_request(str(error), None) from error


def check_model(body: SamplingFields, limits: ModelLimits) -> None:
    if body.model != limits.served_model_name:
        raise bad_request(f"model {body.model!r} does not exist; this server serves {limits.served_model_name!r}",
                          "model", code="model_not_found")


def prepare_completion(body: CompletionRequest, limits: ModelLimits) -> PreparedRequest:
    check_model(body, limits)
    ids = completion_prompt_ids(body, limits)
    return PreparedRequest(ids, sampling_params(body, len(ids), limits, body.max_tokens, "prompt"))


def prepare_chat(body: ChatCompletionRequest, limits: ModelLimits) -> PreparedRequest:
    check_model(body, limits)
    ids = chat_prompt_ids(body, limits)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return PreparedRequest(ids, sampling_params(body, len(ids), limits, requested, "messages"))
