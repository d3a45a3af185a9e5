"""Request schemas of the OpenAI API (the fields servelab honours) and OpenAI's error object.

Fields are typed strictly (``"5"`` is not an int, ``1`` is not a bool), as OpenAI's own API
rejects them; a wrong type is a 400 naming the field. Fields the server does not know are
ignored (clients send many optional ones), except that those listed here must have the right type.

Sampling fields: ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``, ``top_p``,
``seed``, ``stop``, ``n`` (only 1), and vLLM's extensions ``top_k``, ``min_p``, ``priority``
(used by ``scheduler.policy=priority``; lower is served first), ``ignore_eos`` and
``return_token_ids`` (the response carries the generated token ids).
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False   # a last chunk with usage and empty choices


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)       # OpenAI's default; 0 = greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)                   # vLLM extension; 0 / -1 = no limit
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)      # vLLM extension; 0 = no limit
    priority: int = 0                                      # vLLM extension; lower first (policy=priority)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1)
    ignore_eos: bool = False                               # vLLM extension
    return_token_ids: bool = False                         # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a text prompt or token ids (a batch of one is accepted)."""

    prompt: Union[str, list[int], list[str], list[list[int]]]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: str
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        """The content as one string (text parts joined; other part types are rejected upstream)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)   # OpenAI's newer name for max_tokens


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class APIError(Exception):
    """An error answered with an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)
