"""Decode-step roofline: how far is the engine's decode step from this machine's lower bound?

    python -m experiments.bench.roofline [--model smollm2-135m] [--dtype float32] [--device cpu] [--attention auto]
                                   [--batch-sizes 1 8 32] [--context 128] [--steps 10] [--out DIR]

1. Measures the machine: memory bandwidth (the better of a large tensor copy, counting the read
   and the write, and a large read-only reduction: a decode step mostly *reads* weights, and a
   read-only stream runs faster than a copy on some CPUs) and matmul peak (best of large square
   matmuls in ``--dtype``; on CPU float32 the best of ``torch.mm``, a oneDNN-prepacked linear and
   servelab's skinny GEMM, the paths the engine can take). Both are best cases by definition,
   so that no engine path can beat the bound. Both are probed again after each batch size's
   steps and the best probes are used: on a host whose speed drifts (a shared VM: the same read
   ran at 28-34 and at 70-75 GB/s minutes apart, docs/performance.md, section 2), a probe taken in a
   slow minute would make a bound that the steps of a fast minute beat.
2. For each batch size ``B``: starts ``B`` requests with ``--context`` prompt tokens, runs their
   prefill, then times ``--steps`` engine decode steps (``LLM.step()``: scheduler, runner,
   forward, sampler; median) with every sequence at about ``--context`` tokens.
3. Lower bound of one decode step = ``max(bytes / bandwidth, flops / peak)``:

   * bytes: every weight once (the tied LM head reads the embedding matrix; the embedding lookup
     itself reads only ``B`` rows) + the K/V context read by attention
     (``2 * layers * B * context * kv_heads * head_dim`` elements);
   * flops: ``2 * B * (projection + LM head parameters)`` + attention's
     ``4 * B * context * heads * head_dim`` per layer.

Prints one table (measured ms, memory-bound ms, FLOP-bound ms, bound, ratio = measured / bound)
and, with ``--out``, writes ``roofline.csv`` and ``roofline.md`` there. Timings on a shared
machine are noisy: rerun, compare medians.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from engine.device import DTYPES, resolve_device, resolve_dtype
from experiments.results.files import write_csv, write_text_file


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn, device: torch.device, repeats: int, statistic=statistics.median, warmup: int = 2) -> float:
    """Seconds per call of ``fn``: the median for the engine's steps, the minimum (``statistic=min``)
    for the machine's ceilings, which are best cases by definition (like STREAM's best rate)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistic(times)


def measure_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 9) -> tuple[float, float]:
    """Bytes per second of a large copy (read + write counted) and of a large read-only ``sum``."""
    numel = megabytes * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy = 2 * numel * 4 / seconds_per_call(lambda: dst.copy_(src), device, repeats, min)
    read = numel * 4 / seconds_per_call(lambda: src.sum(), device, repeats, min)
    return copy, read


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 9) -> float:
    """FLOP/s of large square matmuls in ``dtype`` (the best path the engine can use)."""
    size = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    flops = 2 * size**3
    best = flops / seconds_per_call(lambda: torch.mm(a, b), device, repeats, min)
    from engine.weight_copies import onednn_linear_supported, packed_linear, prepack_weight
    from engine.native import NativeKernelUnavailable
    from engine.skinny_gemm import SkinnyGemm

    if onednn_linear_supported(device, dtype):
        weight = b.t().contiguous()
        packed = prepack_weight(weight, size)
        best = max(best, flops / seconds_per_call(lambda: packed_linear(a, packed, None), device, repeats, min))
        try:
            gemm = SkinnyGemm()
        except NativeKernelUnavailable:
            return best
        panels = gemm.pack(weight)
        best = max(best, flops / seconds_per_call(lambda: gemm.linear(a, panels, None, size), device, repeats, min))
    return best


@dataclasses.dataclass
class DecodeCost:
    weight_bytes: int
    kv_bytes: int
    flops: int


def decode_cost(model: torch.nn.Module, config, batch: int, context: int, dtype: torch.dtype) -> DecodeCost:
    """Bytes and FLOPs one decode step of ``batch`` sequences at ``context`` tokens must move/do."""
    element = torch.empty((), dtype=dtype).element_size()
    embed = model.embed_tokens.weight.numel()
    params = sum(p.numel() for p in model.parameters())
    # Weights read once: all parameters (the tied LM head is the embedding matrix, read in full).
    weight_bytes = params * element
    matmul_params = params - embed + (embed if model.lm_head is None else 0)  # projections + LM head
    matmul_params -= sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    kv_elements = 2 * config.num_hidden_layers * batch * context * config.num_key_value_heads * config.head_dim
    attention_flops = 4 * batch * context * config.num_attention_heads * config.head_dim * config.num_hidden_layers
    return DecodeCost(weight_bytes, kv_elements * element, 2 * batch * matmul_params + attention_flops)


def time_decode_steps(llm, batch: int, context: int, steps: int, seed: int = 0) -> float:
    """Median wall time of ``steps`` engine decode steps with ``batch`` sequences at ~``context`` tokens."""
    from engine.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(seed)
    vocab = llm.model_config.vocab_size
    warmup = 2
    # Long enough to outlive admission: prompts may be prefilled over up to ``batch`` steps.
    params = SamplingParams(max_tokens=steps + warmup + 1 + batch, ignore_eos=True)
    for _ in range(batch):
        prompt = torch.randint(min(5, vocab - 1), vocab, (context,), generator=generator).tolist()
        llm.add_request(prompt, params)
    while llm.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in llm.scheduler.running):
        llm.step()  # prefill (possibly over several steps)
    for _ in range(warmup):
        llm.step()
    if llm.scheduler.num_running != batch:
        raise RuntimeError(f"only {llm.scheduler.num_running} of {batch} sequences run together: raise capacity_tokens / max_num_seqs")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - start)
    for seq in list(llm.scheduler.running):  # stop everyone after its next token (no abort API)
        seq.sampling_params = dataclasses.replace(seq.sampling_params, max_tokens=seq.num_output_tokens + 1)
    while llm.has_unfinished():
        llm.step()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES) + ["auto"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention", default="auto",
                        help="attention backend; auto = cpu_paged for float32 on CPU (servelab_best), else torch_sdpa")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prepack", default="auto", help="LLM(prepack=...): auto | true | false")
    parser.add_argument("--out", type=Path, default=None, help="folder for roofline.csv / roofline.md")
    args = parser.parse_args(argv)

    from engine.llm import LLM

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    prepack = {"true": True, "false": False}.get(str(args.prepack).lower(), args.prepack)
    attention = args.attention
    if attention == "auto":
        attention = "cpu_paged" if device.type == "cpu" and dtype == torch.float32 else "torch_sdpa"
    probes = [measure_bandwidth(device)]  # (copy, read) bytes/s; again after each batch size below
    peaks = [measure_matmul_peak(device, dtype)]
    # Room for every sequence's whole life at once, so all B run together (+1 block of slack each).
    per_seq = args.context + args.steps + 4 + max(args.batch_sizes) + 16
    llm = LLM(model=args.model, device=str(device), dtype=args.dtype, attention=attention,
              max_num_seqs=max(args.batch_sizes), capacity_tokens=max(16384, max(args.batch_sizes) * per_seq),
              prepack=prepack)
    measured_steps = []
    for batch in args.batch_sizes:
        measured_steps.append(time_decode_steps(llm, batch, args.context, args.steps))
        probes.append(measure_bandwidth(device))
        peaks.append(measure_matmul_peak(device, dtype))
    peak = max(peaks)
    copy_bandwidth, read_bandwidth = max(c for c, _ in probes), max(r for _, r in probes)
    bandwidth = max(copy_bandwidth, read_bandwidth)
    print(f"machine: {device}, {torch.get_num_threads()} threads; bandwidth {bandwidth / 1e9:.1f} GB/s (best of "
          f"{len(probes)} probes: copy {copy_bandwidth / 1e9:.1f}, read {read_bandwidth / 1e9:.1f}; reads "
          f"{', '.join(f'{r / 1e9:.1f}' for _, r in probes)}); matmul peak {peak / 1e9:.1f} GFLOP/s "
          f"({args.dtype}; probes {', '.join(f'{x / 1e9:.0f}' for x in peaks)}); attention {attention}")
    rows = []
    for batch, measured in zip(args.batch_sizes, measured_steps):
        cost = decode_cost(llm.model, llm.model_config, batch, args.context + args.steps // 2, dtype)
        memory_s = (cost.weight_bytes + cost.kv_bytes) / bandwidth
        flop_s = cost.flops / peak
        bound = max(memory_s, flop_s)
        rows.append({
            "model": args.model, "dtype": args.dtype, "device": str(device), "attention": attention,
            "batch": batch, "context": args.context,
            "measured_ms": round(measured * 1e3, 2), "memory_bound_ms": round(memory_s * 1e3, 2),
            "flop_bound_ms": round(flop_s * 1e3, 2), "bound_ms": round(bound * 1e3, 2),
            "ratio": round(measured / bound, 2), "achieved_gflops": round(cost.flops / measured / 1e9, 1),
            "bandwidth_gbs": round(bandwidth / 1e9, 1), "copy_bandwidth_gbs": round(copy_bandwidth / 1e9, 1),
            "read_bandwidth_gbs": round(read_bandwidth / 1e9, 1), "peak_gflops": round(peak / 1e9, 1),
        })
    columns = ["batch", "context", "measured_ms", "memory_bound_ms", "flop_bound_ms", "bound_ms", "ratio", "achieved_gflops"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    print("\n".join(lines))
    if args.out is not None:
        header = (f"Decode-step roofline: {args.model}, {args.dtype} on {device}, attention {attention}; bandwidth "
                  f"{bandwidth / 1e9:.1f} GB/s (copy {copy_bandwidth / 1e9:.1f}, read {read_bandwidth / 1e9:.1f}), "
                  f"matmul peak {peak / 1e9:.1f} GFLOP/s.\n\n")
        # crash-safe, and an earlier roofline in the folder is kept (roofline_1.csv ... is written)
        write_csv(pd.DataFrame(rows), args.out / "roofline.csv")
        write_text_file(header + "\n".join(lines) + "\n", args.out / "roofline.md")
    return rows


if __name__ == "__main__":
    main()
