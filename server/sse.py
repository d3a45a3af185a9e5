"""Server-sent events, as OpenAI streams them: ``data: <json>`` lines, a blank line after each
event, and a final ``data: [DONE]``. An error inside a stream (after the 200 status went out)
is an event whose JSON is OpenAI's error object, followed by ``[DONE]``.
"""
from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    """One SSE event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
