"""servelab's engine: ``LLM`` (add_request / step / generate) and ``SamplingParams``."""
from engine.outputs import RequestOutput, StepRecord
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # Imported on first use: engine.llm imports strategies/, which import engine.sequence,
    # so an eager import here would be circular (and pull torch + Hydra into every import).
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "StepRecord"]
