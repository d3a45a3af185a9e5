"""servelab's engine: ``LLM`` (add_request / step / generate) and ``SamplingParams``."""
from engine.outputs import RequestOutput, StepRecord
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # Imported on first use: engine.llm pulls in torch + Hydra, which plain imports of
    # SamplingParams / RequestOutput (e.g. by a strategy module) should not pay for.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "StepRecord"]
