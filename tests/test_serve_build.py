"""serve.py builds and warms up the engine in a thread that exits before serving starts, so the
engine thread is the process's only OpenMP master (see ``serve.in_passing_thread``)."""
from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from engine.llm import LLM

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("serve", ROOT / "serve.py")
serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve)


def test_in_passing_thread_returns_the_result_and_reraises_the_error() -> None:
    seen: list[threading.Thread] = []

    def build() -> str:
        seen.append(threading.current_thread())
        return "built"

    assert serve.in_passing_thread(build) == "built"
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()

    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        serve.in_passing_thread(fail)


def test_app_builds_and_warms_the_engine_off_the_main_thread(monkeypatch) -> None:
    threads: dict[str, threading.Thread] = {}
    build, generate = LLM.build, LLM.generate

    def recording_build(self, *args, **kwargs):
        threads["build"] = threading.current_thread()
        return build(self, *args, **kwargs)

    def recording_generate(self, *args, **kwargs):
        threads["warm-up"] = threading.current_thread()
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "build", recording_build)
    monkeypatch.setattr(LLM, "generate", recording_generate)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("serve", overrides=["model=tiny", "device=cpu", "server.warmup_requests=1"])
    app = serve.app_from_config(cfg)
    assert app.state.servelab.limits.served_model_name == "tiny"
    assert threads["build"] is threads["warm-up"] is not threading.main_thread()
    assert not threads["build"].is_alive()  # exited: its OpenMP pool is gone before the engine thread starts
