"""Hugging Face baselines behind the driver's engine surface (see ``experiments.harness.driver.ServingEngine``).

Both load the very checkpoint servelab loads (``engine.loader.checkpoint_for_spec``, as ``LLM.from_config`` does)
with ``AutoModelForCausalLM`` and report :class:`engine.outputs.RequestOutput` records, so
``requests.csv`` and ``summary.json`` have the same columns for every engine.

* :class:`HFStaticEngine` (``engine=hf_static``) — the naive server: fixed batches of
  ``batch_size`` requests in arrival order through ``model.generate`` (left-padded, greedy,
  ``max_new_tokens`` = the batch's largest ``max_tokens``). ``generate`` streams the batch's
  new tokens to a :class:`StepClock` streamer once per decoding step; the time of step ``i`` is
  the time of every row's ``i``-th token, so TTFT (the prefill step), ITL and TPOT are measured.
  A row that reached its ``max_tokens`` stops there, but its slot keeps computing until the
  batch's longest row is done (its finish is its last token; the batch ends later). One step
  record per batch: its wasted
  slots are decode slots of rows that had already produced their ``max_tokens``
  (``sum(max_new_tokens - max_tokens_i)``); its KV columns are the padded rectangle HF's
  cache grows to (reserved) vs. the real tokens in it (used).
* :class:`HFContinuousEngine` (``engine=hf_continuous``) — transformers' own paged continuous
  batching (the manager behind ``model.generate_batch``), fed in real time through
  ``manager.add_request`` with a per-request ``max_new_tokens`` and per-token timestamps
  (``record_timestamps``). It exposes no per-step records, so steps.csv is empty.

EOS: HF ``generate`` always runs with EOS disabled here (our model instance's
``generation_config.eos_token_id`` is cleared); each row is then cut to its own ``max_tokens``
and, unless ``ignore_eos``, at its first EOS / stop token — greedy rows are independent, so
this equals per-request stopping. Both peers support greedy decoding only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from engine.device import resolve_device, resolve_dtype
from engine.loader import checkpoint_for_spec, read_model_config
from engine.model_config import ModelConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer


@dataclass
class PendingRequest:
    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float


def load_hf_model(cfg: DictConfig, attn_implementation: str) -> tuple[Any, ModelConfig, torch.device, Any | None]:
    """The run's checkpoint as an HF model (eval, no grads, EOS stopping disabled), its config,
    device and tokenizer (``None`` if the checkpoint has none: the job decodes output text with it)."""
    from transformers import AutoModelForCausalLM

    # Exactly the engine's lookup (engine.llm.LLM.build), so both load the same weights.
    path = Path(checkpoint_for_spec(cfg.model))
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    model = model.to(device).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model_config = read_model_config(path)
    return model, model_config, device, load_tokenizer(path)


def _check_greedy(sampling_params: SamplingParams) -> None:
    if not sampling_params.greedy:
        raise NotImplementedError("HF peers support greedy decoding only (temperature=0)")
    if sampling_params.stop:
        raise NotImplementedError("HF peers do not support stop strings (SamplingParams.stop)")


def truncate_output(token_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...]) -> tuple[list[int], str]:
    """Cut a row generated without EOS stopping as the request would have stopped."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    for index, token in enumerate(token_ids[: params.max_tokens]):
        if token in stops:
            return token_ids[: index + 1], "stop"
    return token_ids[: params.max_tokens], "length"


class StepClock:
    """A ``generate`` streamer (transformers' ``BaseStreamer`` protocol) that records when each
    decoding step's tokens reached the host. ``generate`` calls ``put`` once with the prompt,
    then once per step with that step's token of every row, then ``end``."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.step_times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call hands over the prompt, not a generated token
            self._prompt_seen = True
            return
        self.step_times.append(self.clock())

    def end(self) -> None:
        pass


class _QueueingPeer:
    """Shared request bookkeeping of both peers."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any | None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.step_records: list[dict[str, Any]] = []
        self._next_id = 0

    def clock(self) -> float:
        return time.perf_counter()

    def _new_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams, arrival_time: float | None) -> PendingRequest:
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        _check_greedy(sampling_params)
        request = PendingRequest(self._next_id, list(prompt_token_ids), sampling_params,
                                 self.clock() if arrival_time is None else arrival_time)
        self._next_id += 1
        return request


class HFStaticEngine(_QueueingPeer):
    """Fixed batches through ``model.generate``; see the module docstring."""

    def __init__(self, model: Any, model_config: ModelConfig, device: torch.device, batch_size: int,
                 tokenizer: Any | None = None) -> None:
        super().__init__(model_config, tokenizer)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.device = device
        self.batch_size = batch_size
        self.waiting: list[PendingRequest] = []

    @classmethod
    def from_config(cls, cfg: DictConfig, batch_size: int = 8, attn_implementation: str = "sdpa") -> "HFStaticEngine":
        model, model_config, device, tokenizer = load_hf_model(cfg, attn_implementation)
        return cls(model, model_config, device, batch_size, tokenizer)

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams, arrival_time: float | None = None) -> int:
        request = self._new_request(prompt_token_ids, sampling_params, arrival_time)
        self.waiting.append(request)
        return request.request_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def _left_padded(self, batch: list[PendingRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r.prompt_token_ids) for r in batch)
        pad = 0
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            n = len(request.prompt_token_ids)
            input_ids[row, width - n:] = torch.tensor(request.prompt_token_ids)
            attention_mask[row, width - n:] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Run the next batch (up to ``batch_size`` waiting requests, arrival order) to completion."""
        if not self.waiting:
            return []
        batch, self.waiting = self.waiting[: self.batch_size], self.waiting[self.batch_size:]
        input_ids, attention_mask = self._left_padded(batch)
        max_new = max(r.sampling_params.max_tokens for r in batch)
        step_clock = StepClock(self.clock)
        start = self.clock()
        generated = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
            max_new_tokens=max_new, pad_token_id=0, streamer=step_clock,
        )[:, input_ids.shape[1]:].tolist()
        end = self.clock()
        if len(step_clock.step_times) != len(generated[0]):
            raise RuntimeError(f"generate streamed {len(step_clock.step_times)} steps for {len(generated[0])} tokens")
        outputs = []
        for request, row in zip(batch, generated):
            tokens, reason = truncate_output(row, request.sampling_params, self.model_config.eos_token_ids)
            times = step_clock.step_times[: len(tokens)]
            outputs.append(RequestOutput(
                request_id=request.request_id, prompt_token_ids=request.prompt_token_ids, token_ids=tokens,
                finished=True, finish_reason=reason, arrival_time=request.arrival_time,
                first_scheduled_time=start, first_token_time=times[0], token_times=times, finish_time=times[-1],
            ))
        self.step_records.append(self._batch_record(batch, outputs, input_ids.shape[1], max_new, start, end))
        return outputs

    def _batch_record(self, batch: list[PendingRequest], outputs: list[RequestOutput], width: int, max_new: int,
                      start: float, end: float) -> dict[str, Any]:
        rows = len(batch)
        return {
            "step": len(self.step_records), "start_time": start, "end_time": end, "duration_s": end - start,
            "num_seqs": rows, "num_prefill_tokens": rows * width, "num_decode_tokens": rows * (max_new - 1),
            "num_wasted_slots": sum(max_new - len(o.token_ids) for o in outputs),
            "kv_used_tokens": sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outputs),
            "kv_reserved_tokens": rows * (width + max_new), "kv_capacity_tokens": None,
            "num_preempted": 0, "prefix_hit_tokens": 0, "num_waiting": len(self.waiting), "num_running": rows,
            "forward_passes": max_new,
        }


class HFContinuousEngine(_QueueingPeer):
    """transformers' continuous batching manager, fed in real time; see the module docstring."""

    def __init__(self, manager: Any, model_config: ModelConfig, tokenizer: Any | None = None) -> None:
        super().__init__(model_config, tokenizer)
        self.manager = manager
        self.in_flight: dict[str, PendingRequest] = {}

    @classmethod
    def from_config(
        cls,
        cfg: DictConfig,
        max_num_seqs: int = 32,
        capacity_tokens: int = 16384,
        page_size: int = 16,
        max_batch_tokens: int | None = None,
        allow_block_sharing: bool = False,
        attn_implementation: str = "sdpa",
    ) -> "HFContinuousEngine":
        from transformers import ContinuousBatchingConfig, GenerationConfig

        model, model_config, _, tokenizer = load_hf_model(cfg, attn_implementation)
        generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=16)
        cb_config = ContinuousBatchingConfig(
            page_size=page_size, num_blocks=max(capacity_tokens // page_size, 1),
            max_batch_tokens=max_batch_tokens or min(capacity_tokens, model_config.max_model_len),
            max_requests_per_batch=max_num_seqs, allow_block_sharing=allow_block_sharing,
        )
        manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=cb_config)
        manager.start()
        return cls(manager, model_config, tokenizer)

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams, arrival_time: float | None = None) -> int:
        request = self._new_request(prompt_token_ids, sampling_params, arrival_time)
        eos = -1 if sampling_params.ignore_eos else list(self.model_config.eos_token_ids) or -1
        self.in_flight[f"req_{request.request_id}"] = request
        self.manager.add_request(
            request.prompt_token_ids, request_id=f"req_{request.request_id}",
            max_new_tokens=sampling_params.max_tokens, record_timestamps=True, eos_token_id=eos,
        )
        return request.request_id

    def has_unfinished(self) -> bool:
        return bool(self.in_flight)

    def step(self, timeout_s: float = 0.02) -> list[RequestOutput]:
        """Collect every result the manager's thread finished (waits up to ``timeout_s`` for the first)."""
        outputs = []
        result = self.manager.get_result(timeout=timeout_s)
        while result is not None:
            if result.is_finished():
                outputs.append(self._to_output(result))
            result = self.manager.get_result(timeout=0.0)
        if not outputs and not self.manager.is_running():
            raise RuntimeError(f"transformers' continuous batching loop stopped with {len(self.in_flight)} requests left")
        return outputs

    def _to_output(self, result: Any) -> RequestOutput:
        request = self.in_flight.pop(result.request_id)
        if result.error is not None:
            raise RuntimeError(f"hf_continuous request {result.request_id} failed: {result.error}")
        tokens, reason = truncate_output(list(result.generated_tokens), request.sampling_params,
                                         self.model_config.eos_token_ids)
        times = list(result.timestamps or [])[: len(tokens)]
        finish = times[-1] if times else result.lifespan[1]
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids, token_ids=tokens, finished=True,
            finish_reason=reason, arrival_time=request.arrival_time, first_scheduled_time=result.lifespan[0],
            first_token_time=times[0] if times else finish, token_times=times, finish_time=finish,
        )

    def close(self) -> None:
        self.manager.stop(block=True, timeout=10)
        self.manager.destroy()
