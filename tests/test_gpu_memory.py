"""KV cache sizing from a GPU's memory (``capacity_tokens: auto``), checked on the CPU with a fake
device: the arithmetic, the token budget CUDA gets by default, the profiling forward's wiring,
and the start-up errors that name the numbers."""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.config import engine_config
from engine.gpu_memory import (
    CUDA_TOKEN_BUDGET, GIB, default_token_budget, kv_bytes_per_token, kv_capacity_tokens, profiling_step,
    size_for_device,
)
from engine.runner import ModelRunner
from strategies.cache.paged import PagedCache


class FakeDevice:
    """A device of ``total`` bytes holding ``weights + other`` bytes; a forward's peak is
    ``activation`` bytes above what was allocated before it."""

    def __init__(self, total: int, weights: int, other: int, activation: int) -> None:
        self.total, self.weights, self.other, self.activation = total, weights, other, activation
        self.resets = 0

    def free_and_total(self) -> tuple[int, int]:
        return self.total - self.weights - self.other, self.total

    def reset_peak(self) -> None:
        self.resets += 1

    def allocated(self) -> int:
        return self.weights

    def peak_allocated(self) -> int:
        return self.weights + self.activation


QWEN_05B_BF16 = kv_bytes_per_token(num_layers=24, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    """Qwen2.5-0.5B in bf16: 2 (K, V) x 24 layers x 2 KV heads x 64 dims x 2 bytes."""
    assert QWEN_05B_BF16 == 12288
    assert kv_bytes_per_token(2, 2, 16, torch.float32) == 2 * 2 * 2 * 16 * 4


def test_capacity_is_what_utilization_leaves_after_weights_others_and_activations():
    """80 GiB at 0.9 allows 72 GiB; 1 GiB of weights, 2 GiB of another process and a 4 GiB
    activation peak leave 65 GiB, in whole 16-token blocks of 12,288 bytes per token."""
    device = FakeDevice(total=80 * GIB, weights=1 * GIB, other=2 * GIB, activation=4 * GIB)
    free, total = device.free_and_total()
    tokens = kv_capacity_tokens(total, free, 0.9, device.activation, QWEN_05B_BF16, block_size=16, min_tokens=8192)
    assert tokens == (int(80 * GIB * 0.9) - 3 * GIB - 4 * GIB) // 12288 // 16 * 16
    assert tokens % 16 == 0 and tokens * 12288 <= 65 * GIB < (tokens + 16) * 12288
    lower = kv_capacity_tokens(total, free, 0.5, device.activation, QWEN_05B_BF16, 16, 8192)
    assert lower < tokens


def test_too_large_budget_fails_naming_the_numbers():
    """When activations take what the fraction allows, the error names the fraction, the GiB in
    use, the activation peak and the token budget it needed."""
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 of 24.00 GiB.*in use.*peaks at 21.00 GiB.*fewer than 8192"):
        kv_capacity_tokens(24 * GIB, 23 * GIB, 0.9, 21 * GIB, QWEN_05B_BF16, 16, min_tokens=8192)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        kv_capacity_tokens(24 * GIB, 23 * GIB, 1.5, 0, QWEN_05B_BF16, 16, 16)


def test_cuda_gets_a_token_budget_by_default():
    """A null max_num_batched_tokens becomes min(max_model_len, 8192) on CUDA and stays null on the
    CPU; an explicit budget is kept everywhere."""
    cfg = engine_config("tiny", "paged", "continuous", "torch_sdpa", "cpu", "float32", "random", 0, {}, {})
    cfg.scheduler.max_num_batched_tokens = None  # the null budget (conf/scheduler/continuous.yaml sets 256)
    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert default_token_budget(cfg.scheduler, cuda, 32768) == CUDA_TOKEN_BUDGET == 8192
    assert default_token_budget(cfg.scheduler, cuda, 2048) == 2048
    assert default_token_budget(cfg.scheduler, cpu, 32768) is None
    cfg.scheduler.max_num_batched_tokens = 512
    assert default_token_budget(cfg.scheduler, cuda, 32768) == 512


def test_profiling_step_fills_the_budget_with_prompts_of_at_most_max_model_len():
    """10,000 tokens at max_model_len 4,096: prompts of 4096, 4096 and 1808 tokens on disjoint blocks."""
    step = profiling_step(10_000, 4096, block_size=16)
    assert [item.num_new_tokens for item in step] == [4096, 4096, 1808]
    blocks = [block for item in step for block in item.seq.block_table]
    assert blocks == list(range(256 + 256 + 113))


def test_auto_capacity_runs_the_profiling_forward_and_sizes_the_cache(tiny_llama_ckpt):
    """With a fake 1 GiB device, size_for_device runs one profiling forward at the token budget
    (reset the peak once) and writes the arithmetic's capacity into the cache node."""
    cfg = engine_config(str(tiny_llama_ckpt), "paged", "continuous", "torch_sdpa", "cpu", "float32", "random", 0,
                        cache_options={"capacity_tokens": "auto", "block_size": 16},
                        scheduler_options={"max_num_batched_tokens": 200})
    llm = LLM(model=str(tiny_llama_ckpt), device="cpu", attention="torch_sdpa", prepack=False, fused_ops=False)
    device = FakeDevice(total=GIB, weights=100 << 20, other=0, activation=50 << 20)
    sized = size_for_device(cfg, llm.model, llm.model_config, torch.float32, torch.device("cpu"), memory=device)
    mc = llm.model_config
    per_token = kv_bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, torch.float32)
    assert device.resets == 1
    assert sized.cache.capacity_tokens == kv_capacity_tokens(GIB, GIB - (100 << 20), 0.9, 50 << 20, per_token, 16, 200)
    assert cfg.cache.capacity_tokens == "auto"  # the caller's config is not changed
    PagedCache(block_size=16, capacity_tokens=sized.cache.capacity_tokens)


def test_out_of_memory_in_the_profiling_forward_names_the_budget(tiny_llama_ckpt, monkeypatch):
    """A profiling forward that runs out of memory fails start-up with max_num_batched_tokens named."""
    cfg = engine_config(str(tiny_llama_ckpt), "paged", "continuous", "torch_sdpa", "cpu", "float32", "random", 0,
                        cache_options={"capacity_tokens": "auto"}, scheduler_options={"max_num_batched_tokens": 100})
    llm = LLM(model=str(tiny_llama_ckpt), device="cpu", attention="torch_sdpa", prepack=False, fused_ops=False)

    def out_of_memory(self, inputs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(ModelRunner, "execute", out_of_memory)
    device = FakeDevice(total=GIB, weights=0, other=0, activation=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens=100 tokens ran out of device memory"):
        size_for_device(cfg, llm.model, llm.model_config, torch.float32, torch.device("cpu"), memory=device)


def test_auto_capacity_off_cuda_fails_at_start_up(tiny_llama_ckpt):
    """capacity_tokens=auto on the CPU, and 'auto' handed to a cache directly, are clear ValueErrors."""
    with pytest.raises(ValueError, match="capacity_tokens=auto sizes the KV cache from CUDA memory; on cpu"):
        LLM(model=str(tiny_llama_ckpt), device="cpu", capacity_tokens="auto", prepack=False, fused_ops=False)
    with pytest.raises(ValueError, match="capacity_tokens must be a number of tokens here"):
        PagedCache(capacity_tokens="auto")
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        PagedCache(gpu_memory_utilization=0.0)
