"""What the engine reports: one record per finished request and one per step."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass
class RequestOutput:
    """A request's tokens and timestamps (engine clock, seconds; see ``LLM.clock``).

    Attributes:
        request_id: id returned by ``add_request``.
        prompt_token_ids: the prompt.
        token_ids: generated tokens.
        text: the generated text, cumulative and detokenized incrementally (special tokens
            skipped, a stop string and what follows it cut); while the request runs, characters
            of an incomplete UTF-8 character and the tail a stop string could still claim are
            held back, so successive outputs' text only grows. "" when the model has no tokenizer.
        finished: whether the request is done.
        finish_reason: ``"length"`` (max_tokens), ``"stop"`` (EOS / stop token / stop string),
            ``"abort"`` (``LLM.abort_request``) or ``"error"`` (its step's forward pass raised; see ``error``).
        arrival_time: when the request arrived.
        first_scheduled_time: when it first entered a step (queueing ends).
        first_token_time: when its first token was produced.
        token_times: when each generated token was produced.
        finish_time: when it finished.
        num_cached_tokens: prompt tokens served from the prefix cache at its (last) admission.
        num_preemptions: how often it was preempted and recomputed.
        error: the exception text when ``finish_reason == "error"``.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    text: str = ""
    error: str | None = None

    @classmethod
    def from_sequence(cls, seq: Sequence) -> "RequestOutput":
        return cls(
            request_id=seq.seq_id,
            prompt_token_ids=list(seq.prompt_token_ids),
            token_ids=seq.output_token_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
            token_times=list(seq.token_times),
            finish_time=seq.finish_time,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            text=seq.output_text,
            error=seq.error,
        )


@dataclass
class StepRecord:
    """One engine step, as the engine saw it.

    Attributes:
        step: step index from 0.
        start_time / end_time / duration_s: engine clock around schedule + forward + sample.
        num_seqs: rows groups in the batch (including wasted slots).
        num_prefill_tokens: tokens computed for prompts (or recompute after preemption).
        num_decode_tokens: single next-token computations of running sequences.
        num_wasted_slots: finished static-batch members still computing (their output is discarded).
        kv_used_tokens / kv_reserved_tokens / kv_capacity_tokens: KV memory during the step.
        num_preempted: sequences preempted by this step's schedule.
        prefix_hit_tokens: prompt tokens whose prefill this step's admissions skipped.
        num_waiting / num_running: queue and running set after scheduling.
        forward_passes: model forward passes in the step (1 when anything ran).
        swap_out_blocks / swap_in_blocks: KV blocks copied to / back from host swap space in this
            step (``preemption_mode=swap``; 0 otherwise).
        swap_out_bytes / swap_in_bytes: the same in bytes (K and V, all layers).
        swap_time_s: seconds of this step spent copying swapped blocks (inside ``duration_s``).
        num_sampled: rows whose logits the step computed (the LM head's rows).
        context_tokens: keys read by attention, summed over the step's sequences (KV read).
        prefill_attention_pairs: causal query-key pairs of the step's prompt / chunk rows (the quadratic prefill term);
            see :mod:`engine.step_shape`. ``None`` where an engine does not know them (peers).
        padded_attention_pairs: query-key pairs a dense (padded, masked) attention kernel computes for
            the step's prompt / chunk rows (:func:`engine.step_shape.padded_pairs`); ``None`` for peers.
        shared_context_tokens: the part of ``context_tokens`` read from KV blocks another sequence of
            the step reads too (prefix-cache sharing; :func:`engine.step_shape.shared_context_tokens`);
            ``None`` for peers.
    """

    step: int
    start_time: float
    end_time: float
    duration_s: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_wasted_slots: int
    kv_used_tokens: int
    kv_reserved_tokens: int
    kv_capacity_tokens: int
    num_preempted: int
    prefix_hit_tokens: int
    num_waiting: int
    num_running: int
    forward_passes: int
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_time_s: float = 0.0
    num_sampled: int | None = None
    context_tokens: int | None = None
    prefill_attention_pairs: int | None = None
    padded_attention_pairs: int | None = None
    shared_context_tokens: int | None = None
