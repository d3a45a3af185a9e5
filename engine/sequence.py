"""A request's life inside the engine.

Every request is a :class:`Sequence`: its token ids (prompt, then generated tokens), how many
of them already have K/V in the cache (``num_computed_tokens``), its state and its timestamps.
A step computes "some tokens" of each scheduled sequence: a whole prompt, a chunk of it, one
decode token, or — after preemption — the prompt plus everything generated so far again.

Life cycle::

    WAITING --admit--> RUNNING --last token--> FINISHED
                          |  ^
                  preempt |  | re-admit (recompute from token 0)
                          v  |
                        PREEMPTED
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.stop_strings import visible_text


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request. Cache strategies own ``block_table``; schedulers own ``status``.

    ``block_table[i]`` is the physical block that holds logical tokens
    ``[i * block_size, (i + 1) * block_size)``; token ``t`` lives at slot
    ``block_table[t // block_size] * block_size + t % block_size``.
    """

    seq_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # Tokens whose K/V came from the prefix cache at the last admission (they skipped prefill).
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Timestamps (engine clock, seconds): one per generated token, then the finish.
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    error: str | None = None  # why the request failed (finish_reason "error")
    # The output's text, grown token by token (None: the model has no tokenizer).
    detokenizer: IncrementalDetokenizer | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens that still need a forward pass before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_text(self) -> str:
        """The output text so far, minus what a stop string could still cut ("" without a tokenizer)."""
        if self.detokenizer is None:
            return ""
        return visible_text(self.detokenizer.text, self.sampling_params.stop, self.is_finished)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus every token this request may generate: its worst-case KV footprint."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens
