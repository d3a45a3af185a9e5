"""Size the KV cache and the token budget from a GPU's memory, at start-up.

On a GPU the KV cache should take what the weights and the activations leave, not a fixed
number of tokens. vLLM's rule, followed here for ``cache.capacity_tokens: auto``:

1. the engine may use ``gpu_memory_utilization x total`` bytes of the device (0.9 by default);
2. what is in use after the weights are loaded (the weights, other processes, CUDA's context:
   ``total - free``) counts against that;
3. so does the activation peak of a *profiling forward*: one step at the full token budget
   (``max_num_batched_tokens`` prompt tokens, in prompts of at most ``max_model_len``), the
   biggest step the scheduler can ever issue;
4. the rest, divided by the K/V bytes of one token (``2 x layers x kv_heads x head_dim x
   dtype size``), rounded down to whole blocks, is ``capacity_tokens``.

Prefill memory grows with the tokens of a step (the gather backends' masks and K/V copies grow
with the batch and the longest prompt), so on CUDA the default scheduler gets a token budget
(``CUDA_TOKEN_BUDGET``) instead of ``max_model_len``. A budget whose profiling forward does not
fit, or a KV cache smaller than one step's tokens, fails here with the numbers, not with an
out-of-memory error in the middle of a run.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import torch
from omegaconf import DictConfig

from engine.config import instantiate_strategy
from engine.interfaces.cache import allocate_kv_tensors
from engine.interfaces.scheduler import ScheduledSequence
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

GIB = 1 << 30
CUDA_TOKEN_BUDGET = 8192  # the default scheduler's max_num_batched_tokens on CUDA (capped at max_model_len)


class DeviceMemory(Protocol):
    """What the sizing reads from a device (a CUDA device, or a fake one in tests)."""

    def free_and_total(self) -> tuple[int, int]: ...

    def reset_peak(self) -> None: ...

    def allocated(self) -> int: ...

    def peak_allocated(self) -> int: ...


@dataclass(frozen=True)
class CudaMemory:
    """:class:`DeviceMemory` of one CUDA device (``torch.cuda`` counters)."""

    device: torch.device

    def free_and_total(self) -> tuple[int, int]:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_capacity_tokens(total_bytes: int, free_bytes: int, utilization: float, activation_bytes: int,
                       bytes_per_token: int, block_size: int, min_tokens: int) -> int:
    """``capacity_tokens`` for ``utilization`` of a device with ``total_bytes``, ``free_bytes``
    of them free once the weights are loaded, ``activation_bytes`` the profiling forward's peak.

    Raises ``ValueError`` naming the numbers when the rest holds fewer than ``min_tokens`` tokens
    (the token budget: one step's K/V) or not one block."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if bytes_per_token < 1 or block_size < 1:
        raise ValueError(f"bytes_per_token and block_size must be >= 1, got {bytes_per_token} and {block_size}")
    allowed = int(total_bytes * utilization)
    in_use = total_bytes - free_bytes
    kv_bytes = allowed - in_use - activation_bytes
    tokens = max(kv_bytes, 0) // bytes_per_token // block_size * block_size
    if tokens < max(min_tokens, block_size):
        raise ValueError(
            f"capacity_tokens=auto: gpu_memory_utilization={utilization} of {total_bytes / GIB:.2f} GiB allows "
            f"{allowed / GIB:.2f} GiB; {in_use / GIB:.2f} GiB are in use (weights, other processes) and the "
            f"profiling forward at the token budget peaks at {activation_bytes / GIB:.2f} GiB, leaving "
            f"{kv_bytes / GIB:.2f} GiB = {tokens} KV tokens at {bytes_per_token} bytes per token, fewer than "
            f"{max(min_tokens, block_size)} (one step's tokens); raise gpu_memory_utilization or lower "
            f"max_num_batched_tokens"
        )
    return tokens


def default_token_budget(scheduler: DictConfig, device: torch.device, max_model_len: int) -> int | None:
    """The scheduler node's ``max_num_batched_tokens``; when it is ``null``, on CUDA
    ``min(max_model_len, CUDA_TOKEN_BUDGET)`` and elsewhere ``None`` (the scheduler's own default)."""
    budget = scheduler.get("max_num_batched_tokens")
    if budget is None and "max_num_batched_tokens" in scheduler and device.type == "cuda":
        return min(max_model_len, CUDA_TOKEN_BUDGET)
    return budget


@dataclass
class ScratchKV:
    """KV tensors for the profiling forward only: what :class:`engine.runner.ModelRunner` reads
    of a cache strategy (``block_size``, ``kv_caches``)."""

    block_size: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


def profiling_step(token_budget: int, max_model_len: int, block_size: int) -> list[ScheduledSequence]:
    """``token_budget`` prompt tokens as whole prompts of at most ``max_model_len`` tokens, their
    block tables laid end to end from block 0."""
    step, first_block, left = [], 0, token_budget
    while left > 0:
        length = min(left, max_model_len)
        seq = Sequence(seq_id=len(step), prompt_token_ids=[0] * length,
                       sampling_params=SamplingParams(max_tokens=1), arrival_time=0.0)
        blocks = -(-length // block_size)
        seq.block_table = list(range(first_block, first_block + blocks))
        step.append(ScheduledSequence(seq, length))
        first_block += blocks
        left -= length
    return step


def profile_activation_bytes(model: torch.nn.Module, attention, model_config, dtype: torch.dtype,
                             device: torch.device, token_budget: int, block_size: int,
                             memory: DeviceMemory) -> int:
    """Peak bytes allocated by one forward of :func:`profiling_step` above what was allocated
    before it (its scratch KV tensors excluded).

    Raises ``ValueError`` naming the budget when the forward runs out of device memory."""
    mc = model_config
    step = profiling_step(token_budget, mc.max_model_len, block_size)
    num_blocks = sum(len(item.seq.block_table) for item in step)
    scratch = ScratchKV(block_size, allocate_kv_tensors(mc.num_hidden_layers, num_blocks, block_size,
                                                        mc.num_key_value_heads, mc.head_dim, dtype, device))
    runner = ModelRunner(model, scratch, attention, device)
    memory.reset_peak()
    before = memory.allocated()
    try:
        runner.execute(runner.prepare(step))
        peak = memory.peak_allocated()
    except torch.OutOfMemoryError as error:
        del runner, scratch
        free, total = memory.free_and_total()
        raise ValueError(
            f"the profiling forward of max_num_batched_tokens={token_budget} tokens ran out of device memory "
            f"({free / GIB:.2f} of {total / GIB:.2f} GiB free); lower max_num_batched_tokens: {error}"
        ) from None
    return max(peak - before, 0)


def size_for_device(cfg: DictConfig, model: torch.nn.Module, model_config, dtype: torch.dtype,
                    device: torch.device, memory: DeviceMemory | None = None) -> DictConfig:
    """``cfg`` with the token budget and ``capacity_tokens: auto`` resolved for ``device`` (a copy;
    ``cfg`` itself is unchanged). ``memory`` defaults to the CUDA device's counters; ``auto``
    on another device without one raises ``ValueError``."""
    mc = model_config
    budget = default_token_budget(cfg.scheduler, device, mc.max_model_len)
    cfg = copy.deepcopy(cfg)
    if "max_num_batched_tokens" in cfg.scheduler:
        cfg.scheduler.max_num_batched_tokens = budget
    if cfg.cache.get("capacity_tokens") != "auto":
        return cfg
    if memory is None:
        if device.type != "cuda":
            raise ValueError(f"capacity_tokens=auto sizes the KV cache from CUDA memory; on {device} give a number of tokens")
        memory = CudaMemory(device)
    step_tokens = budget if budget is not None else mc.max_model_len
    block_size = int(cfg.cache.block_size)
    activation = profile_activation_bytes(model, instantiate_strategy(cfg.attention), mc, dtype, device,
                                          step_tokens, block_size, memory)
    free, total = memory.free_and_total()
    cfg.cache.capacity_tokens = kv_capacity_tokens(
        total, free, float(cfg.cache.gpu_memory_utilization), activation,
        kv_bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, dtype),
        block_size, min_tokens=step_tokens,
    )
    return cfg
