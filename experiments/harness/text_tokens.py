"""Text to token ids for text workloads (datasets), with or without a tokenizer.

With the model's tokenizer a prompt is encoded exactly as a server would encode it (no special
tokens added: a chat request goes through the chat template instead). A model without one (the
tiny test model, a simulator model that is config only) still runs text workloads: each
whitespace-separated word becomes one stand-in token, a fixed hash of the word onto the
vocabulary's non-special ids. Lengths then follow the text (one token per word, about 0.75 of a
real tokenizer's count for English), and equal words give equal ids, so shared text is shared
prefix for the cache as well.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from typing import Any

from experiments.harness.workloads import TokenSampler

Encoder = Callable[[str], list[int]]


def text_encoder(tokenizer: Any | None, vocab_size: int, special_token_ids: Iterable[int]) -> Encoder:
    """A function from text to prompt token ids: the tokenizer's, else one stand-in id per word."""
    if tokenizer is not None:
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    allowed = TokenSampler(vocab_size, special_token_ids, seed=0).allowed
    return lambda text: [int(allowed[zlib.crc32(word.encode("utf-8")) % allowed.size]) for word in text.split()]
