"""Incremental detokenization: a request's text grows with every generated token.

Decoding the whole output after every token costs O(length) per token; decoding the new token
alone is wrong twice over: a byte-level BPE token can hold *part* of a UTF-8 character (an emoji
or a CJK character is often 2-4 byte tokens, each of which decodes to U+FFFD "�" on its own),
and some tokenizers (SentencePiece) only know whether a token starts with a space from the
token before it.

The classic answer (Hugging Face TGI, vLLM's incremental detokenizer) keeps two offsets into the
token list: ``prefix_offset`` .. ``read_offset`` are tokens already turned into text that serve
as context; each step decodes ``tokens[prefix_offset:read_offset]`` and ``tokens[prefix_offset:]``
and emits the difference — unless the new decode ends in "�", i.e. the last token stopped in the
middle of a character: then nothing is emitted and the bytes wait for the next token. Both decodes
cover a handful of tokens, so each step costs O(1). The first output token gets the prompt's last
few tokens as context. When the request finishes, bytes still held back are released
(:meth:`IncrementalDetokenizer.flush`), so a finished request's text is the full decode of its
output (a character cut by ``max_tokens`` shows as U+FFFD).

Special tokens (EOS, chat-turn markers) are skipped, as in vLLM's default.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.tokenizer import decode

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output token (vLLM uses 5)


class IncrementalDetokenizer:
    """The text of one request's output, extended one token at a time.

    Attributes:
        text: the output decoded so far (characters still incomplete are held back).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.token_ids = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def append(self, token_id: int) -> str:
        """Add one generated token; returns the new text it completes ("" while a character is incomplete)."""
        self.token_ids.append(int(token_id))
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return ""
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The request finished: release held-back bytes too (they decode to U+FFFD), so the
        final text is the full decode of the output. Returns what was released."""
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        rest = self._decode(self.token_ids[self.prefix_offset:])[len(before):]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += rest
        return rest

    def truncate(self, length: int) -> None:
        """Cut the text to its first ``length`` characters (a stop string was found there)."""
        self.text = self.text[:length]

    def _decode(self, token_ids: list[int]) -> str:
        return decode(self.tokenizer, token_ids)
