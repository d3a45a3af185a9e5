"""Stop strings: end a request when its text contains one, and stream text that never shrinks.

A stop string can span several tokens ("\\n\\nUser:" may be three), so it is searched in the
detokenized text, not in token ids. Only the characters that can contain a *new* match are
searched: a stop string that ends inside the new text starts at most ``len(stop) - 1``
characters before it. The request's text is then cut where the stop string begins (the stop
string itself is not part of the output, as in vLLM and the OpenAI API).

Streaming: a server sends the growth of the text after every step. While a request runs, its
last ``max(len(stop)) - 1`` characters could still turn out to be the beginning of a stop string
and be cut away; they are held back (:func:`visible_text`), so the visible text only ever grows.
"""
from __future__ import annotations

from collections.abc import Sequence


def find_stop_string(text: str, num_new_chars: int, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string that ends in the last ``num_new_chars`` characters of
    ``text`` begins, or ``None``."""
    earliest = None
    for stop in stops:
        index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if index != -1 and (earliest is None or index < earliest):
            earliest = index
    return earliest


def visible_text(text: str, stops: Sequence[str], finished: bool) -> str:
    """The part of ``text`` that can be shown now: all of it once finished, else all but the
    characters a stop string could still claim."""
    if finished or not stops:
        return text
    held_back = max(len(stop) for stop in stops) - 1
    return text[: max(0, len(text) - held_back)]
