"""The checkpoint's tokenizer: text prompts to token ids, chat messages through the chat template.

A checkpoint folder with tokenizer files (``tokenizer.json`` / ``tokenizer_config.json``, as HF
writes them) gets its Hugging Face tokenizer; a folder without (the random-weight checkpoints)
gets ``None`` and serves token ids only.

Chat: the model's chat template (Jinja, shipped with the tokenizer) renders a conversation into
the exact text the model was trained on, with ``add_generation_prompt`` opening the assistant's
turn. The rendered text already holds its special tokens, so it is encoded without adding any
(no second BOS), as vLLM does.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
Message = Mapping[str, str]


def load_tokenizer(checkpoint: str | Path) -> Any | None:
    """The HF tokenizer saved in ``checkpoint``, or ``None`` when the folder has no tokenizer files."""
    path = Path(checkpoint)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def require_tokenizer(tokenizer: Any | None, what: str) -> Any:
    if tokenizer is None:
        raise ValueError(f"{what} needs a tokenizer, and this model has none (its checkpoint folder has no "
                         f"tokenizer files): pass token-id prompts, or use a model with a tokenizer such as "
                         f"smollm2-135m-instruct")
    return tokenizer


def encode_prompt(tokenizer: Any | None, prompt: str) -> list[int]:
    """A text prompt's token ids (with the special tokens the tokenizer adds to plain text, if any)."""
    return list(require_tokenizer(tokenizer, "a text prompt").encode(prompt))


def render_chat(tokenizer: Any | None, messages: Sequence[Message]) -> str:
    """The conversation rendered by the model's chat template, ending with the assistant's turn opened."""
    tokenizer = require_tokenizer(tokenizer, "chat")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use generate() with a text prompt")
    for message in messages:
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"a chat message is a dict with 'role' and 'content', got {message!r}")
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True)


def encode_chat(tokenizer: Any | None, messages: Sequence[Message]) -> list[int]:
    """The token ids of :func:`render_chat` (its special tokens are in the text: none are added)."""
    text = render_chat(tokenizer, messages)  # checks the tokenizer first
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: Any | None, token_ids: Sequence[int]) -> str:
    """The text of ``token_ids`` (special tokens skipped); "" without a tokenizer."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def special_token_ids(tokenizer: Any | None) -> list[int]:
    """Every special or added token id (control tokens random prompts must avoid)."""
    if tokenizer is None:
        return []
    ids = set(tokenizer.all_special_ids)
    ids.update(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}))
    return sorted(ids)
