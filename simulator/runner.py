"""The simulator's runner, sampler and clock: the three things that replace the model.

``engine.LLM.step`` calls ``runner.prepare`` -> ``runner.execute`` -> ``sampler`` and reads
``clock()`` around them. Here ``prepare`` keeps only which rows would be sampled and the step's
shape, ``execute`` counts the shape against the calibration's ranges (:mod:`simulator.extrapolation`),
asks the cost model how long the step takes and moves the virtual clock by that much, and the sampler returns deterministic stand-in tokens. The step's bookkeeping
(computed tokens, prefix publishing, retirement, the step record) stays the engine's own.
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np

from engine.interfaces.scheduler import ScheduledSequence
from engine.sequence import Sequence
from engine.step_shape import MIN_DECODE_RUN, StepShape
from simulator.cost_model import CostModel
from simulator.extrapolation import ExtrapolationCount


class VirtualClock:
    """Seconds since the simulated engine started; moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds})")
        self.now += seconds

    def advance_to(self, time: float) -> None:
        """Jump forward to ``time`` (a time already passed leaves the clock where it is)."""
        self.now = max(self.now, time)


@dataclass
class SimulatedStep:
    """What ``prepare`` hands ``execute``: the sampled rows (same meaning as ``StepInputs.sampled``)."""

    sampled: list[ScheduledSequence]
    shape: StepShape


class CostModelRunner:
    """Prices a step instead of running it, counting the steps outside the calibration's ranges."""

    def __init__(self, cost_model: CostModel, clock: VirtualClock, block_size: int,
                 extrapolation: ExtrapolationCount | None = None) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.extrapolation = extrapolation or ExtrapolationCount.for_hardware(cost_model.hardware)
        self.block_size = block_size  # the cache's (shared KV blocks)
        self.min_decode_run = MIN_DECODE_RUN  # the real runner's split of mixed steps (padded attention pairs)

    def prepare(self, scheduled: list[ScheduledSequence]) -> SimulatedStep:
        sampled = [
            item for item in scheduled
            if item.is_padding or item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens
        ]
        return SimulatedStep(sampled=sampled, shape=StepShape.of(scheduled, self.min_decode_run, self.block_size))

    def execute(self, step: SimulatedStep) -> SimulatedStep:
        self.extrapolation.observe(step.shape)
        self.clock.advance(self.cost_model.step_time(step.shape))
        return step  # stands in for the logits: the sampler needs nothing else


class StandInSampler:
    """Deterministic output tokens: a function of the sequence so far, never an EOS id.

    Like greedy decoding, the same tokens always continue the same way (so identical prompts
    share prefix-cache blocks as they would for real). With ``mean_output_tokens`` set, a request
    that does not ``ignore_eos`` ends with EOS after a geometric number of tokens with that mean,
    drawn from ``(seed, request id)`` (an output-length distribution); otherwise EOS never comes
    and requests run to ``max_tokens``.
    """

    def __init__(self, vocab_size: int, eos_token_ids: SequenceOf[int], seed: int = 0,
                 mean_output_tokens: float | None = None) -> None:
        if mean_output_tokens is not None and mean_output_tokens < 1:
            raise ValueError(f"mean_output_tokens must be >= 1 or None, got {mean_output_tokens}")
        if mean_output_tokens is not None and not eos_token_ids:
            raise ValueError("mean_output_tokens needs a model with an EOS token id")
        self.vocab_size = vocab_size
        self.eos = set(eos_token_ids)
        if len(self.eos) >= vocab_size:
            raise ValueError("every token id of the vocabulary is an EOS id")
        self.seed = seed
        self.mean_output_tokens = mean_output_tokens
        self.output_lengths: dict[int, int] = {}

    def __call__(self, step: SimulatedStep, seqs: list[Sequence]) -> list[int]:
        return [self.next_token(seq) for seq in seqs]

    def next_token(self, seq: Sequence) -> int:
        if self.mean_output_tokens is not None and seq.num_output_tokens + 1 >= self.output_length(seq):
            return min(self.eos)
        token = (seq.token_ids[-1] * 1_103_515_245 + 12_345 + seq.num_tokens) % self.vocab_size
        while token in self.eos:
            token = (token + 1) % self.vocab_size
        return token

    def output_length(self, seq: Sequence) -> int:
        if seq.seq_id not in self.output_lengths:
            rng = np.random.default_rng([self.seed, seq.seq_id])
            self.output_lengths[seq.seq_id] = int(rng.geometric(1.0 / self.mean_output_tokens))
        return self.output_lengths[seq.seq_id]
