"""``SimulatedLLM``: ``engine.LLM`` with the model forward replaced by a cost model.

It inherits ``add_request`` / ``validate`` / ``step`` / ``has_unfinished`` / ``generate`` and the
step records from ``engine.LLM``, and builds the cache and scheduler exactly as the engine does
(``LLM.build_scheduling``: Hydra ``instantiate`` of ``cfg.cache`` / ``cfg.scheduler``). What
differs: no weights are loaded, the cache never allocates its K/V tensors (block accounting
needs none: ``allocate_tensors`` is simply not called, so ``cache.kv_caches`` stays empty),
``clock()`` is a virtual clock that the runner advances by each step's modelled duration, and
the driver advances it over idle gaps (``advance_clock_to``) instead of sleeping.

The KV budget: ``kv_capacity="auto"`` derives ``capacity_tokens`` from the hardware's memory
when the hardware has a size (``memory * memory_utilization - weight bytes``, divided by KV bytes
per token; see docs/simulator.md), and keeps ``cache.capacity_tokens`` otherwise.
"""
from __future__ import annotations

import logging
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from engine.config import available, engine_config, load_group_option
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.tokenizer import load_tokenizer
from simulator import model_shapes
from simulator.cost_model import CostModel
from simulator.extrapolation import ExtrapolationCount, ExtrapolationLimits
from simulator.hardware import Hardware
from simulator.runner import CostModelRunner, StandInSampler, VirtualClock

log = logging.getLogger(__name__)


def kv_capacity_from_memory(hardware: Hardware, model_config, memory_utilization: float) -> int:
    """KV tokens that fit in the hardware's memory next to the weights (vLLM's
    ``gpu_memory_utilization`` share of memory, minus the weights; activations are not modelled)."""
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    weights = model_shapes.parameter_count(model_config) * hardware.dtype_bytes
    free = hardware.memory_bytes * memory_utilization - weights
    per_token = model_shapes.kv_bytes_per_token(model_config, hardware.dtype_bytes)
    if free < per_token:
        raise ValueError(
            f"model weights ({weights / 1e9:.1f} GB) leave no KV memory on {hardware.name} "
            f"({hardware.memory_bytes / 1e9:.0f} GB x {memory_utilization}); raise hardware.tensor_parallel"
        )
    return int(free // per_token)


class SimulatedLLM(LLM):
    """The engine's surface on a virtual clock.

    ``SimulatedLLM(model="llama-3.1-8b", hardware="h100", cache="paged", ...)`` takes ``LLM``'s
    strategy arguments plus ``hardware`` (``conf/hardware/<name>.yaml``); ``engine=simulated``
    builds it with :meth:`from_config`. An explicit ``capacity_tokens`` wins over the budget
    derived from the hardware's memory.
    """

    def __init__(  # noqa: PLR0913 -- mirrors LLM's keyword surface
        self,
        model: str = "smollm2-135m",
        hardware: str = "h100",
        cache: str = "paged",
        scheduler: str = "continuous",
        block_size: int | None = None,
        capacity_tokens: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        chunked_prefill: bool | None = None,
        seed: int = 0,
        memory_utilization: float = 0.9,
        mean_output_tokens: float | None = None,
        strict: bool = False,
    ) -> None:
        cfg = engine_config(
            model, cache, scheduler, "torch_sdpa", "cpu", "float32", "random", seed,
            cache_options={"block_size": block_size, "capacity_tokens": capacity_tokens},
            scheduler_options={"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                               "chunked_prefill": chunked_prefill},
        )
        self.build_simulated(cfg, instantiate(load_group_option("hardware", hardware, {})),
                             None if capacity_tokens is not None else "auto", memory_utilization, mean_output_tokens,
                             ExtrapolationLimits(strict=strict))

    @classmethod
    def from_config(  # type: ignore[override]
        cls, cfg: DictConfig, kv_capacity: int | str | None = "auto", memory_utilization: float = 0.9,
        mean_output_tokens: float | None = None,
    ) -> "SimulatedLLM":
        """Build from a composed config with ``model``, ``cache``, ``scheduler``, ``hardware``, ``seed``.

        Args:
            kv_capacity: ``"auto"`` (from the hardware's memory if it has a size, else
                ``cache.capacity_tokens``), ``None`` (always ``cache.capacity_tokens``) or a
                number of tokens.
            memory_utilization: share of device memory for weights + KV (vLLM's default 0.9).
            mean_output_tokens: ``None`` (outputs never hit EOS) or the mean of a geometric
                output-length distribution for requests without ``ignore_eos``.

        ``cfg.simulator`` (conf/config.yaml: ``strict``, ``warn_share``, ``warn_ratio``) says when
        a run extrapolates too far beyond the calibration (:mod:`simulator.extrapolation`).
        """
        if cfg.get("hardware") is None:
            raise ValueError(f"engine=simulated needs hardware=<name>; known: {', '.join(available('hardware'))}")
        limits = ExtrapolationLimits(**OmegaConf.to_container(cfg.simulator, resolve=True)) \
            if cfg.get("simulator") is not None else ExtrapolationLimits()
        llm = cls.__new__(cls)
        llm.build_simulated(cfg, instantiate(cfg.hardware), kv_capacity, memory_utilization, mean_output_tokens,
                            limits)
        return llm

    def build_simulated(
        self, cfg: DictConfig, hardware: Hardware, kv_capacity: int | str | None, memory_utilization: float,
        mean_output_tokens: float | None, limits: ExtrapolationLimits,
    ) -> None:
        hf_config, checkpoint = model_shapes.hf_config_of(cfg.model)
        self.model_config = model_shapes.model_config_for_costs(hf_config)
        # A real checkpoint's tokenizer (text prompts, stop strings); named architectures have none.
        self.tokenizer = None if checkpoint is None else load_tokenizer(checkpoint)
        self.hardware = hardware
        model_name = cfg.model.get("name")
        if hardware.calibrated and hardware.calibrated_model not in (None, model_name):
            log.warning("hardware %s was calibrated on %s; simulating %s with it extrapolates (its step overhead "
                        "holds that model's weight read)", hardware.name, hardware.calibrated_model, model_name)
        cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # a private copy to set the budget on
        capacity = self.kv_capacity(cfg, kv_capacity, memory_utilization)
        if capacity is not None:
            cfg.cache.capacity_tokens = capacity
        self.config = cfg
        self.build_scheduling(cfg, allocate_kv=False)
        self.virtual_clock = VirtualClock()
        self.extrapolation = ExtrapolationCount.for_hardware(hardware, limits)
        self.runner = CostModelRunner(CostModel(hardware, self.model_config), self.virtual_clock, self.cache.block_size,
                                      self.extrapolation)
        self.sampler = StandInSampler(self.model_config.vocab_size, self.model_config.eos_token_ids, int(cfg.seed),
                                      mean_output_tokens)
        self.timing_label = hardware.timing_label

    def kv_capacity(self, cfg: DictConfig, kv_capacity: int | str | None, memory_utilization: float) -> int | None:
        """The KV budget in tokens to impose on the cache, or ``None`` to keep ``cache.capacity_tokens``."""
        if kv_capacity is None or (kv_capacity == "auto" and self.hardware.memory_bytes is None):
            return None
        if kv_capacity == "auto":
            return kv_capacity_from_memory(self.hardware, self.model_config, memory_utilization)
        if isinstance(kv_capacity, int) and kv_capacity >= 1:
            return kv_capacity
        raise ValueError(f"kv_capacity must be 'auto', null or a positive number of tokens, got {kv_capacity!r}")

    def step(self) -> list[RequestOutput]:
        """``LLM.step``, then ``simulator.strict``'s refusal if the step lay too far outside the calibration."""
        outputs = super().step()
        self.extrapolation.raise_refusal()
        return outputs

    # -- the virtual clock ---------------------------------------------------------------------
    def clock(self) -> float:  # type: ignore[override]
        """Virtual seconds: advanced by every step's modelled time and by :meth:`advance_clock_to`."""
        return self.virtual_clock.now

    def advance_clock_to(self, time: float) -> None:
        """Let virtual time pass while the engine is idle (the driver's wait for the next arrival)."""
        self.virtual_clock.advance_to(time)

    def describe(self) -> dict[str, Any]:
        """What a summary records about the simulation (after a run: how far it left the calibration)."""
        return {"timing": self.timing_label, "hardware": self.hardware.name,
                "kv_capacity_tokens": self.cache.stats().capacity_tokens,
                "extrapolation": self.extrapolation.report()}

    def start_run(self) -> None:
        """The start of a measured run: the steps counted so far (warm-up) are forgotten."""
        self.extrapolation.reset()

    def finish_run(self) -> None:
        """The end of a measured run: warn if it extrapolated too far; ``simulator.strict``: refuse it."""
        self.extrapolation.enforce()
