"""Per-request sampling settings, shaped like vLLM's ``SamplingParams``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Attributes:
        max_tokens: number of tokens to generate (at least 1).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep only the k most likely tokens (0 or -1 = no limit).
        top_p: keep the smallest set of tokens whose probability sums to >= top_p (1.0 = no limit),
            measured on what min_p and top_k left (vLLM's order of filters).
        min_p: drop tokens less likely than ``min_p`` times the most likely one (0.0 = no limit).
        seed: a per-request seed; the request then samples the same tokens whatever else
            is in the batch and whichever strategies run. ``None`` uses the engine's generator.
        ignore_eos: keep generating after the end-of-sequence token (benchmarks use this).
        stop_token_ids: extra token ids that end the request (besides EOS unless ignored).
        priority: scheduling priority under ``scheduler.policy=priority`` (an int; lower is
            served first and preempted last; ties in arrival order). Other policies ignore it.
        stop: strings that end the request when its text contains one (a str or a list of them
            is accepted); the text ends before it and ``finish_reason`` is ``"stop"``. Needs a
            model with a tokenizer. While the request runs, ``RequestOutput.text`` holds back
            its last ``max(len(s) for s in stop) - 1`` characters (see ``engine.stop_strings``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    priority: int = 0
    stop: tuple[str, ...] = ()
    min_p: float = 0.0

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)  # frozen: normalised once, here
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (no limit) or positive, got {self.top_k}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer (lower is served first), got {self.priority!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
