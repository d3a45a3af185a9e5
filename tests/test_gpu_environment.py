"""The GPU block of ``summary.json``'s environment, checked on the CPU with ``torch.cuda``, pynvml and
``nvidia-smi`` mocked: the engine's own CUDA device is described (not device 0), the three versions
(torch's CUDA build, the driver's CUDA version, the driver) come from their sources, and a machine
without a GPU or without pynvml / nvidia-smi records ``None`` instead of failing."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from experiments.harness import gpu_environment as gpu_env
from experiments.harness.environment import environment

H200 = SimpleNamespace(name="NVIDIA H200", total_memory=150_000_000_000, major=9, minor=0)
L4 = SimpleNamespace(name="NVIDIA L4", total_memory=24_000_000_000, major=8, minor=9)


@pytest.fixture
def two_gpus(monkeypatch) -> None:
    """A CUDA build of torch seeing an L4 (device 0, current) and an H200 (device 1), driver 560.35.03
    supporting CUDA 12.6, read through a stand-in pynvml."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: [L4, H200][index])
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12060, raising=False)
    calls: list[str] = []
    nvml = SimpleNamespace(NVMLError=type("NVMLError", (Exception,), {}),
                           nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
                           nvmlSystemGetDriverVersion=lambda: b"560.35.03")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return calls


def test_the_engine_device_is_described_with_its_stack(two_gpus):
    """``cuda:1`` is the H200 even though device 0 is current; ``cuda`` is the current device."""
    block = gpu_env.gpu_environment("cuda:1")
    assert block == {"index": 1, "name": "NVIDIA H200", "memory_total_bytes": 150_000_000_000,
                     "compute_capability": "9.0", "device_count": 2, "torch_cuda": "12.4", "cudnn": 90100,
                     "cuda_driver_api": "12.6", "driver": "560.35.03"}
    assert two_gpus == ["init", "shutdown"]  # NVML is shut down after the read
    assert gpu_env.gpu_environment(torch.device("cuda"))["name"] == "NVIDIA L4"


def test_a_cpu_run_on_a_gpu_machine_records_the_stack_but_no_device(two_gpus):
    block = gpu_env.gpu_environment("cpu")
    assert block["index"] is None and block["name"] is None and block["memory_total_bytes"] is None
    assert block["torch_cuda"] == "12.4" and block["driver"] == "560.35.03"
    assert gpu_env.gpu_environment("not-a-device")["index"] is None  # a peer's own device name


def test_driver_version_falls_back_to_nvidia_smi_then_none(two_gpus, monkeypatch):
    """Without pynvml the first line of nvidia-smi's answer is the driver; without either it is None."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monkeypatch.setattr(gpu_env.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    seen: list[list[str]] = []

    def fake_run(command, **kwargs):
        seen.append(command)
        return SimpleNamespace(stdout="550.54.15\n550.54.15\n")

    monkeypatch.setattr(gpu_env.subprocess, "run", fake_run)
    assert gpu_env.driver_version() == "550.54.15"
    assert seen == [["/usr/bin/nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]]

    def failing_run(command, **kwargs):
        raise subprocess.CalledProcessError(9, command)

    monkeypatch.setattr(gpu_env.subprocess, "run", failing_run)
    assert gpu_env.driver_version() is None
    monkeypatch.setattr(gpu_env.shutil, "which", lambda name: None)
    assert gpu_env.driver_version() is None


def test_no_cuda_records_nones(monkeypatch):
    """A CPU-only torch: no device, no driver, torch_cuda None, and nothing CUDA is called."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: pytest.fail("queried a device"))
    block = gpu_env.gpu_environment("cuda:0")
    assert block == {"index": None, "name": None, "memory_total_bytes": None, "compute_capability": None,
                     "device_count": 0, "torch_cuda": None, "cudnn": None, "cuda_driver_api": None,
                     "driver": None}


def test_summary_environment_carries_the_gpu_block(two_gpus):
    """environment() (what summary.json records) describes the engine's device."""
    engine = SimpleNamespace(device=torch.device("cuda", 1), dtype=torch.bfloat16)
    recorded = environment(engine)
    assert recorded["device"] == "cuda:1"
    assert recorded["gpu"]["name"] == "NVIDIA H200" and recorded["gpu"]["driver"] == "560.35.03"
