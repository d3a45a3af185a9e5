"""servelab's simulator: the real schedulers and caches, a cost model instead of the model forward.

``SimulatedLLM`` is ``engine.LLM`` with two parts swapped: the runner prices the step the
scheduler built with a cost model of the hardware (:mod:`simulator.cost_model`) and advances a
virtual clock instead of running a forward pass, and the sampler emits deterministic stand-in
tokens. Admission, chunking, preemption, prefix hits and block accounting are the real code
paths, so they are exact by construction; only time is modelled. No weights are loaded and no
KV tensors are allocated, which is why a 10,000-request run of a 70B model takes seconds.
"""
from simulator.llm import SimulatedLLM

__all__ = ["SimulatedLLM"]
