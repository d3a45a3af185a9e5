"""Measures the two effects the simulator's cost model prices beyond FLOPs and bytes (docs/simulator.md).

``gemm``: the few-row GEMM (``engine/csrc/gemm.c``) over every linear of a model shape (30
layers of q/k/v, o, gate/up, down and the LM head for SmolLM2-135M, weights streamed from memory
as in a decode step), for 1 .. 16, 24 and 32 rows: its time is not linear in the rows but
depends on how they fill the 8-row register tile (``simulator.cost_model.tile_tail_rows``).

``prefill``: whole prefill steps of the real engine (one prompt of L tokens, or n prompts),
split into the attention kernel's time and the rest (the linears, norms, sampling): attention per
causal query-key pair, and the rest per row, which jumps where the oneDNN linears pad their rows
to a bucket (913 rows compute 1,024: ``engine.weight_copies.onednn_row_bucket``).

``shared``: decode steps of 16 users on one 384-token prompt plus 20 tokens each, on the prefix
cache (the prompt's blocks shared by all 16) and on the paged cache (the same tokens, each user
its own blocks): the same context read, once mostly from shared blocks; the difference is what
re-reading a shared block saves. Process CPU time per step (robust on a shared machine).

Rows / cases alternate rep by rep (machine noise hits all) and medians are printed. One thread.

    python -m experiments.bench.step_cost gemm --reps 5
    python -m experiments.bench.step_cost prefill --reps 3
    python -m experiments.bench.step_cost shared --reps 30
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.config import CONF_DIR
from engine.model_config import ModelConfig
from engine.skinny_gemm import SkinnyGemm

GEMM_ROWS = [*range(1, 17), 24, 32]
PREFILL_CASES = [(1, 128), (1, 256), (1, 510), (1, 768), (1, 913), (1, 1024), (2, 456), (8, 100), (16, 260)]


def gemm_times(model: str, reps: int) -> dict[int, float]:
    """Median seconds of one pass of ``rows`` rows through every linear of ``model``'s shape."""
    from omegaconf import OmegaConf

    mc = ModelConfig.from_hf_config(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml").hf_config))
    gemm = SkinnyGemm()
    shapes = [(mc.q_size + 2 * mc.kv_size, mc.hidden_size), (mc.hidden_size, mc.q_size),
              (2 * mc.intermediate_size, mc.hidden_size), (mc.hidden_size, mc.intermediate_size)]
    layers = [[(gemm.pack(torch.randn(n, k)), n, k) for n, k in shapes] for _ in range(mc.num_hidden_layers)]
    layers.append([(gemm.pack(torch.randn(mc.vocab_size, mc.hidden_size)), mc.vocab_size, mc.hidden_size)])
    times: dict[int, list[float]] = {rows: [] for rows in GEMM_ROWS}
    for _ in range(reps):
        for rows in GEMM_ROWS:
            inputs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
            start = time.perf_counter()
            for layer in layers:
                for packed, n, k in layer:
                    gemm.linear(inputs[k], packed, None, n)
            times[rows].append(time.perf_counter() - start)
    return {rows: statistics.median(values) for rows, values in times.items()}


def prefill_times(model: str, reps: int) -> dict[tuple[int, int], tuple[float, float]]:
    """Median (step seconds, attention seconds) of a prefill step of ``n`` prompts of ``L`` tokens."""
    llm = LLM(model=model, weights="random", capacity_tokens=32768)
    attention_s = [0.0]
    forward = llm.attention.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        attention_s[0] += time.perf_counter() - start
        return out

    llm.attention.forward = timed_forward
    params, rng = SamplingParams(max_tokens=1, ignore_eos=True), random.Random(0)
    samples: dict[tuple[int, int], list[tuple[float, float]]] = {case: [] for case in PREFILL_CASES}
    for _ in range(reps):
        for users, length in PREFILL_CASES:
            first, attention_s[0] = len(llm.step_records), 0.0
            llm.generate([[rng.randrange(100, 40000) for _ in range(length)] for _ in range(users)], params)
            assert len(llm.step_records) == first + 1, "one prefill step, nothing else"
            samples[(users, length)].append((llm.step_records[first].duration_s, attention_s[0]))
    return {case: (statistics.median(s for s, _ in v), statistics.median(a for _, a in v)) for case, v in samples.items()}


def shared_times(model: str, reps: int) -> dict[str, tuple[int, int, float]]:
    """Per cache: (context tokens, shared context tokens, median CPU seconds) of a 16-sequence decode step."""
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(384)]
    prompts = [prefix + [rng.randrange(100, 40000) for _ in range(20)] for _ in range(16)]
    params = SamplingParams(max_tokens=reps + 3, ignore_eos=True)
    engines = {cache: LLM(model=model, weights="random", cache=cache, capacity_tokens=16384) for cache in ("prefix", "paged")}
    for llm in engines.values():
        llm.add_request(prompts[0], params)
        llm.step()  # the leader's prefill fills the prefix cache
        for prompt in prompts[1:]:
            llm.add_request(prompt, params)
        llm.step()
        llm.step()
    cpu: dict[str, list[float]] = {cache: [] for cache in engines}
    for _ in range(reps):
        for cache, llm in engines.items():
            start = time.process_time()
            llm.step()
            cpu[cache].append(time.process_time() - start)
            assert llm.step_records[-1].num_decode_tokens == 16, "decode steps of all 16 users"
    return {cache: (llm.step_records[-1].context_tokens, llm.step_records[-1].shared_context_tokens,
                    statistics.median(cpu[cache])) for cache, llm in engines.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("gemm", "prefill", "shared"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.what == "gemm":
        print("| rows | few-row GEMM, all linears (ms) |\n| --- | --- |")
        for rows, seconds in gemm_times(args.model, args.reps).items():
            print(f"| {rows} | {1e3 * seconds:.2f} |")
    elif args.what == "shared":
        print("| cache | context tokens | of them shared | decode step CPU (ms) |\n| --- | --- | --- | --- |")
        for cache, (context, shared, seconds) in shared_times(args.model, args.reps).items():
            print(f"| {cache} | {context} | {shared} | {1e3 * seconds:.2f} |")
    else:
        print("| prompts x tokens | step (ms) | attention (ms) | rest (ms) | attention per pair (us) | rest per row (ms) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for (users, length), (step, attention) in prefill_times(args.model, args.reps).items():
            pairs, rows = users * length * (length + 1) / 2, users * length
            print(f"| {users} x {length} | {1e3 * step:.1f} | {1e3 * attention:.1f} | {1e3 * (step - attention):.1f} "
                  f"| {1e6 * attention / pairs:.2f} | {1e3 * (step - attention) / rows:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
