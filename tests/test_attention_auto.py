"""``attention=auto`` (the default) picks the backend for the device and dtype, and says so."""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.native import NativeKernelUnavailable
from strategies.attention import auto
from strategies.attention.cpu_paged import CpuPagedBackend
from strategies.attention.torch_sdpa import TorchSDPABackend


@pytest.mark.parametrize("device, dtype, expected", [
    ("cpu", torch.float32, CpuPagedBackend),
    ("cpu", torch.bfloat16, TorchSDPABackend),  # cpu_paged's kernel is float32 only
    ("cpu", torch.float16, TorchSDPABackend),
    ("cuda", torch.bfloat16, auto.CUDA_CHOICE),
    ("cuda", torch.float32, auto.CUDA_CHOICE),
    ("mps", torch.float32, TorchSDPABackend),
])
def test_preferred_backend_per_device_and_dtype(device, dtype, expected) -> None:
    assert auto.preferred_backend(torch.device(device), dtype) is expected


def test_engine_default_is_auto_and_builds_cpu_paged_on_cpu_float32(tiny_llama_ckpt) -> None:
    llm = LLM(model=str(tiny_llama_ckpt), device="cpu")
    assert llm.config.attention._target_ == "strategies.attention.auto.select_attention_backend"
    assert isinstance(llm.attention, CpuPagedBackend) and llm.attention.name == "cpu_paged"
    assert isinstance(LLM(model=str(tiny_llama_ckpt), device="cpu", dtype="bfloat16").attention, TorchSDPABackend)


def test_missing_compiler_falls_back_to_torch_sdpa_with_a_warning(monkeypatch) -> None:
    class KernelThatCannotBuild(CpuPagedBackend):
        def __init__(self) -> None:
            raise NativeKernelUnavailable("no C compiler found (set CC or install gcc)")

    monkeypatch.setattr(auto, "CpuPagedBackend", KernelThatCannotBuild)
    with pytest.warns(UserWarning, match="no C compiler"):
        backend = auto.select_attention_backend("cpu", "float32")
    assert isinstance(backend, TorchSDPABackend)
