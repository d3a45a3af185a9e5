"""Device strings and the current CUDA device, checked on the CPU with ``torch.cuda`` mocked:
``cuda:N`` is parsed and bounded by the devices present, and the thread that steps the engine
(the server's engine thread included) makes the engine's device current."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from engine.device import activate, on_device, resolve_device
from server.engine_thread import EngineThread
from server.metrics import ServerMetrics


@pytest.fixture
def two_gpus(monkeypatch) -> list[tuple[str, torch.device]]:
    """``torch.cuda`` reporting two devices, device 0 current; returns the set_device calls
    as ``(thread name, device)``."""
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append((threading.current_thread().name, device)))
    return calls


def test_cuda_strings_carry_their_index(two_gpus):
    """``cuda:1`` stays device 1, ``cuda`` and ``auto`` become the current device, ``cpu`` stays."""
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


def test_bad_device_strings_name_the_limit(two_gpus):
    """An index past the devices present, and a string torch cannot parse, are ValueErrors."""
    with pytest.raises(ValueError, match=r"CUDA device index 2 but only 2 device\(s\) \(0-1\)"):
        resolve_device("cuda:2")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")


def test_cuda_without_a_gpu_is_a_value_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device is available"):
        resolve_device("cuda:0")


def test_activate_sets_the_current_cuda_device_only_for_cuda(two_gpus):
    activate(torch.device("cpu"))
    assert two_gpus == []
    activate(torch.device("cuda", 1))
    assert two_gpus == [(threading.current_thread().name, torch.device("cuda", 1))]
    with on_device(torch.device("cpu")):  # a no-op context off CUDA
        pass


def test_server_engine_thread_makes_the_engine_device_current(two_gpus):
    """The engine thread calls set_device(cuda:1) in its own thread before it steps the engine."""
    idle_llm = SimpleNamespace(device=torch.device("cuda", 1), has_unfinished=lambda: False)
    engine = EngineThread(idle_llm, ServerMetrics("test"), max_waiting=4, idle_poll_s=0.01)
    engine.start()
    engine.stop(timeout_s=5.0)
    assert not engine.thread.is_alive()
    assert engine.failure is None
    assert two_gpus == [("servelab-engine", torch.device("cuda", 1))]
