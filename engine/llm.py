"""The public engine API, shaped like vLLM's ``LLM``.

One step is scheduler -> runner -> sampler:

1. the scheduler picks each running sequence's new tokens (and admits / preempts), asking the
   cache strategy for memory;
2. the runner flattens the step into one varlen batch and runs the model once;
3. the sampler picks the next token of every sequence whose uncomputed tokens are done;
   finished sequences retire and free their memory in the same step.

Text in, text out: prompts may be strings (encoded by the checkpoint's tokenizer) or token ids;
``chat`` renders messages through the model's chat template; every new token extends the
request's text incrementally (:mod:`engine.detokenizer`), where stop strings are looked for
(:mod:`engine.stop_strings`).
"""
from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from typing import Any

import torch
from omegaconf import DictConfig

from engine.config import engine_config, instantiate_strategy
from engine.detokenizer import IncrementalDetokenizer
from engine.device import activate, resolve_device, resolve_dtype
from engine.gpu_memory import size_for_device
from engine.loader import checkpoint_for_spec, load_model
from engine.model_config import ModelConfig
from engine.outputs import RequestOutput, StepRecord
from engine.performance_options import AppliedOption, PerformanceOptions, apply_performance_options
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_kernels import SamplingKernels
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.step_shape import StepShape
from engine.stop_strings import find_stop_string
from engine.tokenizer import Message, encode_chat, encode_prompt, load_tokenizer, require_tokenizer
from engine.interfaces.scheduler import SchedulerOutput, SchedulerStalled


class LLM:
    """A serving engine over one model with one cache, scheduler and attention strategy.

    Args:
        model: a named model (``conf/model/<name>.yaml``: ``smollm2-135m-instruct`` (real
            weights, the default), ``tiny``, ``smollm2-135m``, ``qwen2.5-0.5b``), a folder with an
            HF Llama/Qwen2 checkpoint, or a ``.gguf`` file (converted once into the cache).
        cache / scheduler / attention: strategy names (``conf/<group>/<name>.yaml``); the default
            ``attention="auto"`` builds the fastest backend correct for the device and dtype
            (``strategies/attention/auto.py``: ``cpu_paged`` on CPU float32), named by ``self.attention.name``.
        device: ``auto`` (cuda, then mps, then cpu) or a torch device string.
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``.
        block_size, capacity_tokens: cache options (``None`` keeps the YAML default).
        max_num_seqs, max_num_batched_tokens, chunked_prefill: scheduler options.
        scheduler_options / attention_options: any other option of the chosen YAML, by name
            (e.g. ``{"policy": "priority"}``, ``{"preemption_mode": "swap", "swap_space_tokens": 4096}``);
            ``ValueError`` for an option the strategy does not have.
        weights: ``random`` (seeded random weights, built once and cached), ``pretrained``, or
            ``None`` (the named model's own setting).
        seed: seeds the sampler's shared generator.
        prepack: performance option (docs/performance.md). ``"auto"`` (default) gives every
            projection and the LM head a oneDNN-prepacked weight copy when running float32 on
            a CPU with oneDNN (1.3-2.3x faster matmuls here), plus a copy in the panels of
            servelab's skinny GEMM for decode batches (<= 128 rows with AVX-512, <= 32 with AVX2)
            when its C kernel builds (another 1.1-1.7x there); each copy costs the linear weights'
            size in memory. ``True``
            requires oneDNN, ``False`` keeps plain ``F.linear``.
        prefill_dtype: performance option, the dtype of the oneDNN-prepacked copies, which serve
            the steps of more rows than the skinny GEMM takes (prompts). ``"float32"`` (default)
            changes no result. ``"bfloat16"`` packs them in bfloat16 and rounds those steps'
            inputs to bfloat16 (float32 sums and outputs); it needs ``prepack`` and a CPU with
            bfloat16 dot products (AVX512-BF16 or AMX), else a ``ValueError``. ``"int16"``: the
            integer GEMM of ``decode_dtype="int16"`` (which it needs) serves them too (below);
            ``"int8"`` likewise beside ``decode_dtype="int8"``.
            ``"auto"``: bfloat16 where the CPU has them, int16 where ``decode_dtype`` ``auto``
            takes int16, else float32. Decode-sized steps stay float32 / quantized;
            under bfloat16 a prompt's tokens can depend on how its step was composed, so every
            token-identity claim of the project holds for float32 (docs/decisions.md). ``LLM()``
            keeps float32; ``run.py`` and ``serve.py`` pass ``auto`` (conf/engine/servelab.yaml).
        decode_dtype: performance option, the dtype of the skinny GEMM's panels, which serve
            decode-sized steps (up to 128 rows) above the quantized GEMM's rows (all of them
            without GGUF blocks). ``"float32"`` (default) changes no result. ``"bfloat16"`` packs
            them in bfloat16 pairs and multiplies with AVX512-BF16's dot products (half the weight
            bytes, ~2x faster on an AMD EPYC; inputs rounded to bfloat16, float32 sums): needs
            ``prepack`` and a CPU and compiler target with AVX512-BF16, else a ``ValueError``.
            On a CPU with AMX the bfloat16 panels are multiplied on AMX tiles
            (``engine/csrc/gemm_amx.c``, up to 256 rows, 1.2-2.6x faster than oneDNN's AMX copies
            at 8-256 rows; decision 24), so every step of the default 256-token budget can run whole
            layers in C. ``"auto"``: bfloat16 where it has them, except beside bfloat16 oneDNN
            copies on a CPU with AMX but without the AMX panel kernel, where those copies serve
            every step above 8 rows and the panels stay float32 (decision 19). ``"int16"``: decode batches of 5-32 rows take the
            integer GEMM over the GGUF blocks (:mod:`engine.integer_gemm`; activations rounded to
            int16 per block of 32, int32 sums, 1.2-1.4x faster than float32 panels on an AVX2-only
            AMD EPYC): needs ``prepack`` and ``quantized_weights`` with a GGUF checkpoint, else a
            ``ValueError``; ``"auto"`` takes it on CPUs with neither bfloat16 dot products nor
            AVX-512 (decision 20). Same caveat on token identity as ``prefill_dtype``; there
            ``prefill_dtype="int16"`` (``"auto"`` with ``decode_dtype`` auto) gives prompt steps of
            up to 4096 rows to the integer GEMM too (1.2-1.5x faster than oneDNN float32 there).
            ``"int8"``: the same GEMM with activations rounded to int8 per block of 32
            (AVX512-VNNI's ``vpdpbusd``; 1.5-1.6x faster than bfloat16 oneDNN from 64 rows on an
            AMD EPYC with AVX512-BF16), needs a CPU and compiler target with AVX512-VNNI; opt-in
            only: its logits move several times as far from float32 as bfloat16's (decision 22).
        kv_cache_dtype: performance option, the KV cache's dtype (vLLM's ``kv_cache_dtype``).
            ``"model"`` (default): the model's dtype; changes no result. ``"bfloat16"``: K/V are
            rounded to bfloat16 as they are written and widened to float32 as attention reads
            them, half the bytes a step reads from the cache (the most of attention's time in a
            decode step of many or long sequences): needs a float32 model on the CPU and
            ``attention`` ``cpu_paged`` (or ``auto``, which builds it), else a ``ValueError``.
            ``"auto"``: bfloat16 where the prompt steps compute in bfloat16 or int8 (``prefill_dtype``
            applied), the model's dtype elsewhere (decision 21). Under bfloat16 a
            request's tokens may differ from float32's where two candidates are near a tie.
        prefill_attention_dtype: performance option, the arithmetic of long prompt chunks'
            attention over a bfloat16 KV cache. ``"float32"`` (default): the C kernel, float32
            arithmetic, for every row. ``"bfloat16"``: chunks of at least 16 new tokens, 256
            context tokens and 16,384 query-key pairs run through torch's flash-attention kernel in bfloat16
            (:mod:`strategies.attention.bf16_prompt_attention`; 1.4-3.1x faster per chunk from
            32 x 512 pairs on a Xeon with AMX): needs ``kv_cache_dtype`` bfloat16 and
            ``cpu_paged``, else a ``ValueError``. ``"auto"``: bfloat16 there on a CPU with AMX,
            float32 elsewhere (decision 23). Same caveat on token identity as ``kv_cache_dtype``.
        quantized_weights: performance option. ``"auto"`` (default): for a checkpoint converted
            from a GGUF file (``model=smollm2-135m-instruct``, a ``.gguf`` path), every weight stored
            there as Q4_1 or Q8_0 also keeps its blocks, and inputs of at most
            ``QuantizedGemm.max_rows`` rows (decode steps) are multiplied with them by servelab's
            quantized GEMM (:mod:`engine.quantized_gemm`; 4-6x fewer bytes per step than float32,
            the same weight values) when running float32 on a CPU and its C kernel builds.
            ``True`` requires it, ``False`` keeps the float32 weights only (like for like with a
            float32 peer). Recorded in ``self.quantized_weights`` (``None``: not used).
        fused_ops: performance option. ``"auto"`` (default) runs add + RMSNorm, RoPE and
            SiLU-and-multiply as fused C kernels (:mod:`engine.fused_ops`, compiled on first use),
            and the sampler's draws (:mod:`engine.sampling_kernels`), when running float32 on a
            CPU and a C compiler is found (else the eager PyTorch ops, with a warning); ``True`` requires them, ``False`` keeps the eager ops. With the
            skinny GEMM too (``prepack``), steps of at most its row limit also run each decoder
            layer as one C call of the same kernels (:mod:`engine.native_layers`) when the
            attention backend offers its kernel (``cpu_paged``).
        keep_freed_memory: performance option. ``"auto"`` (default) tunes glibc's ``malloc``
            on CPU runs to keep freed activation buffers in the process instead of returning
            and re-faulting them every step (:mod:`engine.host_memory`; process-wide; the process
            keeps its peak heap). ``True`` requires glibc, ``False`` leaves ``malloc`` alone.
        cuda_graphs: performance option. ``True`` replays decode-only steps as CUDA graphs
            (captured per padded batch size and context bucket, see ``engine/cuda_graphs.py``);
            CUDA only, ignored elsewhere. ``False`` (the default until the GPU check's ``graphs``
            part, ``python -m experiments.bench.gpu_check``, docs/gpu.md, has passed on a GPU) runs
            every step eagerly.
    """

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        cache: str = "paged",
        scheduler: str = "continuous",
        attention: str = "auto",
        device: str = "auto",
        dtype: str = "float32",
        block_size: int | None = None,
        capacity_tokens: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        chunked_prefill: bool | None = None,
        weights: str | None = None,
        seed: int = 0,
        prepack: bool | str = "auto",
        cuda_graphs: bool = False,
        fused_ops: bool | str = "auto",
        keep_freed_memory: bool | str = "auto",
        quantized_weights: bool | str = "auto",
        prefill_dtype: str = "float32",
        decode_dtype: str = "float32",
        kv_cache_dtype: str = "model",
        prefill_attention_dtype: str = "float32",
        scheduler_options: dict[str, Any] | None = None,
        attention_options: dict[str, Any] | None = None,
    ) -> None:
        cfg = engine_config(
            model, cache, scheduler, attention, device, dtype, weights, seed,
            cache_options={"block_size": block_size, "capacity_tokens": capacity_tokens},
            scheduler_options={
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens,
                "chunked_prefill": chunked_prefill,
                **(scheduler_options or {}),
            },
            attention_options=attention_options or {},
        )
        self.build(cfg, PerformanceOptions(prepack=prepack, quantized_weights=quantized_weights, fused_ops=fused_ops,
                                           keep_freed_memory=keep_freed_memory, cuda_graphs=cuda_graphs,
                                           prefill_dtype=prefill_dtype, decode_dtype=decode_dtype,
                                           kv_cache_dtype=kv_cache_dtype, prefill_attention_dtype=prefill_attention_dtype))

    @classmethod
    def from_config(
        cls, cfg: DictConfig, prepack: bool | str = "auto", cuda_graphs: bool = False, fused_ops: bool | str = "auto",
        keep_freed_memory: bool | str = "auto", quantized_weights: bool | str = "auto", prefill_dtype: str = "float32",
        decode_dtype: str = "float32", kv_cache_dtype: str = "model", prefill_attention_dtype: str = "float32",
    ) -> "LLM":
        """Build from a composed config with ``model``, ``cache``, ``scheduler``, ``attention``,
        ``device``, ``dtype`` and ``seed`` (what ``run.py`` gets from Hydra).

        Performance options (``conf/engine/servelab.yaml``) come as keyword arguments.
        """
        llm = cls.__new__(cls)
        llm.build(cfg, PerformanceOptions(prepack=prepack, quantized_weights=quantized_weights, fused_ops=fused_ops,
                                          keep_freed_memory=keep_freed_memory, cuda_graphs=cuda_graphs,
                                          prefill_dtype=prefill_dtype, decode_dtype=decode_dtype,
                                          kv_cache_dtype=kv_cache_dtype, prefill_attention_dtype=prefill_attention_dtype))
        return llm

    def build(self, cfg: DictConfig, options: PerformanceOptions) -> None:
        """Load the model, apply the performance ``options`` (:mod:`engine.performance_options`),
        then build cache, scheduler, attention, runner and sampler."""
        self.config = cfg
        self.device = resolve_device(cfg.device)
        activate(self.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        checkpoint = checkpoint_for_spec(cfg.model)
        self.model, self.model_config = load_model(checkpoint, self.dtype, self.device)
        self.tokenizer = load_tokenizer(checkpoint)  # None: the checkpoint serves token ids only
        self.attention = instantiate_strategy(cfg.attention)
        self.performance = apply_performance_options(self.model, self.model_config, checkpoint, self.device,
                                                     self.dtype, options, self.attention)
        mc: ModelConfig = self.model_config
        cfg = self.config = size_for_device(cfg, self.model, mc, self.dtype, self.device)
        self.build_scheduling(cfg, allocate_kv=True)
        self.runner = ModelRunner(self.model, self.cache, self.attention, self.device)
        if self.performance.cuda_graphs:
            self.runner.enable_cuda_graphs(max_num_seqs=getattr(self.scheduler, "max_num_seqs", 256),
                                           max_context=min(mc.max_model_len, self.cache.max_tokens_per_seq()))
        self.sampler = Sampler(cfg.seed, kernels=SamplingKernels() if self.performance.fused else None)

    def build_scheduling(self, cfg: DictConfig, allocate_kv: bool) -> None:
        """The model-independent half of the engine: cache and scheduler from ``cfg.cache`` /
        ``cfg.scheduler`` (Hydra instantiate), the step records and the per-request bookkeeping. Needs
        ``self.model_config``; the simulator (``simulator/``) builds on this alone, without KV tensors
        (``allocate_kv=False``). The tensors exist before the scheduler is built: swap preemption
        sizes its host pool from them."""
        mc: ModelConfig = self.model_config
        self.cache = instantiate_strategy(cfg.cache)
        self.cache.bind_model_limits(mc.max_model_len)
        if allocate_kv:
            self.cache.allocate_tensors(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                        getattr(torch, self.kv_cache_dtype), self.device)
        self.scheduler = instantiate_strategy(cfg.scheduler, cache=self.cache, max_model_len=mc.max_model_len)
        self.step_records: list[StepRecord] = []
        self.request_counter = itertools.count()
        self.cache_stats_so_far = self.cache.stats()  # cumulative counters at the last step record
        # Live requests by id (queued, running, preempted), and aborts to apply at the next step.
        self.requests: dict[int, Sequence] = {}
        self.pending_aborts: list[int] = []
        # Latest output of each request that ``generate()`` stepped past but did not add: handed
        # back by the next ``step()`` so an ``add_request`` caller never loses a result.
        self.deferred_outputs: dict[int, RequestOutput] = {}

    # What the performance options applied, read from ``self.performance`` (AppliedOptions).
    prepacked = AppliedOption()
    prefill_dtype = AppliedOption()
    decode_dtype = AppliedOption()
    kv_cache_dtype = AppliedOption()
    prefill_attention_dtype = AppliedOption()
    skinny_gemm_max_rows = AppliedOption()
    skinny_gemm_tile_rows = AppliedOption()
    onednn_row_buckets = AppliedOption()
    quantized_weights = AppliedOption()
    fused = AppliedOption()
    kept_freed_memory = AppliedOption()

    # -- requests ---------------------------------------------------------------------------
    @staticmethod
    def clock() -> float:
        """The engine clock: ``time.perf_counter()`` seconds. Arrival times use it too."""
        return time.perf_counter()

    def validate(self, prompt_token_ids: SequenceOf[int], params: SamplingParams) -> None:
        """Reject a request that can never be served, naming the limit. Nothing else is touched."""
        mc = self.model_config
        if params.stop:
            require_tokenizer(self.tokenizer, "SamplingParams.stop (stop strings)")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt is empty: a request needs at least 1 prompt token")
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < mc.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {mc.vocab_size})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > mc.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len={mc.max_model_len}"
            )
        fits = self.cache.max_tokens_per_seq()
        if total > fits:
            raise ValueError(
                f"request needs up to {total} KV tokens but the cache can hold at most {fits} "
                f"for one sequence (capacity_tokens); it could never run"
            )
        self.scheduler.validate_request(len(prompt_token_ids), params.max_tokens)

    def prompt_token_ids(self, prompt: str | SequenceOf[int]) -> list[int]:
        """A prompt's token ids: a string is encoded with the model's tokenizer."""
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt)
        return [int(t) for t in prompt]

    def add_request(
        self, prompt: str | SequenceOf[int], sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> int:
        """Queue a request (a text prompt or token ids); returns its id. Raises ``ValueError`` if
        it can never be served (limits counted in tokens)."""
        params = sampling_params or SamplingParams()
        prompt_token_ids = self.prompt_token_ids(prompt)
        self.validate(prompt_token_ids, params)
        seq = Sequence(
            seq_id=next(self.request_counter),
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            detokenizer=None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
        )
        self.scheduler.add(seq)
        self.requests[seq.seq_id] = seq
        return seq.seq_id

    def abort_request(self, request_id: int) -> bool:
        """Abort a queued, running or preempted request.

        It leaves the scheduler and its KV blocks return at the next step boundary (the start of
        the next :meth:`step`, which reports it with ``finish_reason="abort"``). Call it from the
        thread that steps the engine. Returns ``False`` if the id is unknown or already finished.
        """
        if request_id not in self.requests or request_id in self.pending_aborts:
            return False
        self.pending_aborts.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        """Requests pending (queued, running, aborted but not yet reported), or outputs that
        ``generate()`` kept for the next ``step()``."""
        return bool(self.pending_aborts or self.deferred_outputs) or self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step.

        Returns one output per request that got a new token in this step or finished in it
        (``output.finished`` tells which): length / stop, ``"abort"`` for requests aborted since
        the last step, ``"error"`` for the requests of a step whose forward pass raised; plus
        the outputs ``generate()`` kept for requests it did not add.

        Raises :class:`~engine.interfaces.scheduler.SchedulerStalled` if requests are pending but
        nothing can ever be scheduled (``add_request`` rejects such requests, so this is a bug
        report naming the request and the limit, not a state to wait out).
        """
        start = self.clock()
        outputs = self.take_deferred_outputs() + self.apply_aborts(start)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.scheduler.has_unfinished():  # nothing computes, so nothing will ever change
                raise SchedulerStalled(f"engine stalled: {self.scheduler.explain_stall()}")
            return outputs
        for item in plan.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = start
        try:
            inputs = self.runner.prepare(plan.scheduled)
            logits = self.runner.execute(inputs)
            next_tokens = self.sampler(logits, [item.seq for item in inputs.sampled])
        except Exception as error:  # noqa: BLE001 -- fails this step's requests, not the engine
            return outputs + self.fail_step(plan, error)
        now = self.clock()

        shape = StepShape.of(plan.scheduled, self.runner.min_decode_run, self.cache.block_size)
        for item in plan.scheduled:
            if not item.is_padding:
                item.seq.num_computed_tokens += item.num_new_tokens
                self.cache.on_tokens_computed(item.seq)
        sampled = [(item.seq, token) for item, token in zip(inputs.sampled, next_tokens, strict=True) if not item.is_padding]
        advanced = [seq for seq, _ in sampled]
        finished = [seq for seq, token in sampled if self.append_token(seq, token, now)]
        self.record_step(plan, start, shape)
        self.scheduler.retire(finished)
        for seq in finished:
            del self.requests[seq.seq_id]
        return outputs + [RequestOutput.from_sequence(seq) for seq in advanced]

    def apply_aborts(self, now: float) -> list[RequestOutput]:
        """Remove the requests aborted since the last step; their memory returns now."""
        outputs = []
        for request_id in self.pending_aborts:
            seq = self.requests.pop(request_id)
            self.scheduler.abort(seq)
            self.finish(seq, "abort", now)
            outputs.append(RequestOutput.from_sequence(seq))
        self.pending_aborts.clear()
        return outputs

    def fail_step(self, plan: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """A forward pass raised: finish this step's requests with ``"error"``, free their memory.

        Requests not in the step are untouched and keep running in later steps."""
        now = self.clock()
        text = f"{type(error).__name__}: {error}"
        warnings.warn(f"engine step failed; failing its {len(plan.scheduled)} requests: {text}", stacklevel=2)
        outputs = []
        for item in plan.scheduled:
            if item.is_padding:
                continue
            seq = self.requests.pop(item.seq.seq_id)
            self.scheduler.abort(seq)
            self.finish(seq, "error", now)
            seq.error = text
            outputs.append(RequestOutput.from_sequence(seq))
        return outputs

    @staticmethod
    def finish(seq: Sequence, reason: str, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now

    def append_token(self, seq: Sequence, token: int, now: float) -> bool:
        """Append a sampled token (and its text); returns True if the sequence just finished.

        It finishes with ``"stop"`` at a stop string (the text is cut where it begins), EOS (unless
        ``ignore_eos``) or a stop token, else with ``"length"`` at ``max_tokens``; a finished
        request's text releases any bytes held back (:meth:`IncrementalDetokenizer.flush`).
        """
        seq.token_ids.append(token)
        seq.token_times.append(now)
        params = seq.sampling_params
        new_text = seq.detokenizer.append(token) if seq.detokenizer is not None else ""
        stop_at = find_stop_string(seq.detokenizer.text, len(new_text), params.stop) if new_text and params.stop else None
        if stop_at is not None:
            seq.detokenizer.truncate(stop_at)
            reason = "stop"
        elif token in params.stop_token_ids or (not params.ignore_eos and token in self.model_config.eos_token_ids):
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens:
            reason = "length"
        else:
            return False
        if seq.detokenizer is not None and stop_at is None:
            seq.detokenizer.flush()
        self.finish(seq, reason, now)
        return True

    def record_step(self, plan: SchedulerOutput, start: float, shape: StepShape) -> None:
        stats = self.cache.stats()
        end = self.clock()
        before, self.cache_stats_so_far = self.cache_stats_so_far, stats
        self.step_records.append(
            StepRecord(
                step=len(self.step_records),
                start_time=start,
                end_time=end,
                duration_s=end - start,
                num_seqs=len(plan.scheduled),
                num_prefill_tokens=shape.num_prefill_tokens,
                num_decode_tokens=shape.num_decode_tokens,
                num_wasted_slots=shape.num_wasted_slots,
                kv_used_tokens=stats.used_tokens,
                kv_reserved_tokens=stats.reserved_tokens,
                kv_capacity_tokens=stats.capacity_tokens,
                num_preempted=len(plan.preempted),
                prefix_hit_tokens=stats.prefix_hit_tokens - before.prefix_hit_tokens,
                num_waiting=self.scheduler.num_waiting,
                num_running=self.scheduler.num_running,
                forward_passes=1,
                swap_out_blocks=stats.swap_out_blocks - before.swap_out_blocks,
                swap_in_blocks=stats.swap_in_blocks - before.swap_in_blocks,
                swap_out_bytes=stats.swap_out_bytes - before.swap_out_bytes,
                swap_in_bytes=stats.swap_in_bytes - before.swap_in_bytes,
                swap_time_s=stats.swap_time_s - before.swap_time_s,
                num_sampled=shape.num_sampled,
                context_tokens=shape.context_tokens,
                prefill_attention_pairs=shape.prefill_attention_pairs,
                padded_attention_pairs=shape.padded_attention_pairs,
                shared_context_tokens=shape.shared_context_tokens,
            )
        )

    # -- batch convenience --------------------------------------------------------------------
    def generate(
        self,
        prompts: str | SequenceOf[str | SequenceOf[int]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Serve prompts (strings, or token-id lists) to completion; outputs in input order.

        Every prompt is validated against every limit before any is queued, so a bad one rejects
        the call cleanly. Requests added earlier with :meth:`add_request` keep running alongside;
        their outputs are not lost: the latest one of each is kept and returned by the next
        :meth:`step` (``has_unfinished()`` stays True until it is).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = [self.prompt_token_ids(prompt) for prompt in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        for prompt, params in zip(prompts, params_list):
            self.validate(prompt, params)
        request_ids = [self.add_request(prompt, params) for prompt, params in zip(prompts, params_list)]
        wanted = set(request_ids)
        outputs: dict[int, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="requests")
        while wanted - outputs.keys():
            for output in self.step():
                if output.request_id not in wanted:
                    self.deferred_outputs[output.request_id] = output  # cumulative: the latest says all
                elif output.finished:
                    outputs[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [outputs[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: SequenceOf[Message] | SequenceOf[SequenceOf[Message]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts) or a list of them.

        Each conversation is rendered by the model's chat template with the assistant's turn
        opened (``add_generation_prompt``), then served like :meth:`generate`.
        """
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [encode_chat(self.tokenizer, conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def take_deferred_outputs(self) -> list[RequestOutput]:
        """Outputs ``generate()`` stepped past for requests it did not add (oldest request first)."""
        deferred = [self.deferred_outputs[request_id] for request_id in sorted(self.deferred_outputs)]
        self.deferred_outputs.clear()
        return deferred

    def free_blocks_check(self) -> None:
        """Assert no KV memory is held (call when ``has_unfinished()`` is False)."""
        stats = self.cache.stats()
        if stats.num_free_blocks != stats.num_blocks or stats.reserved_tokens or stats.swap_used_blocks:
            raise AssertionError(f"KV leak: {stats}")
