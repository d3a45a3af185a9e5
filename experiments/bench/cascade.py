"""Decode-step attention time, ``cpu_paged`` vs ``cpu_paged_cascade``, at a shared prompt.

One decode step's attention over every layer of a model shape (default SmolLM2-135M: 30 layers,
9 query heads on 3 KV heads, head_dim 64), for ``users`` sequences whose first
``shared_tokens // block_size`` blocks are the same physical blocks (what ``cache=prefix``
produces) followed by ``own_tokens`` private tokens each. K/V are random; both backends read
the same caches. The two backends alternate rep by rep (so machine noise hits both) and the
medians are reported, with their ratio.

``--engine MODEL`` measures whole engine decode steps instead: two ``LLM``s (``cache=prefix``,
one per backend) serve the same users (a leader first, so everyone else shares its prompt
blocks), then take decode steps alternately; medians of ``StepRecord.duration_s`` (wall) and of
the process CPU time of each step. On a machine shared with other jobs, ``--threads 1`` and the
CPU-time columns are the robust comparison (a descheduled process does not accrue CPU time);
with more threads CPU time also counts OpenMP's spin-waiting, so compare wall time on an otherwise
idle machine. The workload-driven counterpart is ``python run.py +experiment=shared_prefix_attention``.

    python -m experiments.bench.cascade --users 1 8 16 30 --shared-tokens 500
    python -m experiments.bench.cascade --engine smollm2-135m --users 8 16 30 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.attention_metadata import AttentionMetadata
from strategies.attention.cpu_paged import CpuPagedBackend
from strategies.attention.cpu_paged_cascade import CpuPagedCascadeBackend


def decode_step(users: int, shared_tokens: int, own_tokens: int, block_size: int, num_kv_heads: int,
                head_dim: int, num_layers: int, seed: int = 0):
    """Caches per layer, the step's metadata, and its query/key/value rows."""
    generator = torch.Generator().manual_seed(seed)
    shared_blocks = shared_tokens // block_size
    context = shared_tokens + own_tokens  # after this step's token is written
    own_blocks = -(-context // block_size) - shared_blocks
    num_blocks = shared_blocks + users * own_blocks
    tables = [list(range(shared_blocks)) + list(range(shared_blocks + u * own_blocks, shared_blocks + (u + 1) * own_blocks))
              for u in range(users)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for _ in range(num_layers)]
    position = context - 1
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(users + 1, dtype=torch.int32),
        query_lens=torch.ones(users, dtype=torch.int32),
        context_lens=torch.full((users,), context, dtype=torch.int32),
        slot_mapping=torch.tensor([t[position // block_size] * block_size + position % block_size for t in tables]),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        block_size=block_size, max_query_len=1, max_context_len=context,
    )
    return caches, metadata


def time_step(backend, caches, metadata, rows, scale: float) -> tuple[float, float]:
    """(wall, process CPU) seconds of one decode step's attention over all layers (metadata fresh
    per step, as in the engine)."""
    step_metadata = AttentionMetadata(**{f: getattr(metadata, f) for f in (
        "query_start_loc", "query_lens", "context_lens", "slot_mapping", "block_tables", "block_size",
        "max_query_len", "max_context_len")})
    query, key, value = rows
    start, start_cpu = time.perf_counter(), time.process_time()
    for k_cache, v_cache in caches:
        backend.forward(query, key, value, k_cache, v_cache, step_metadata, scale)
    return time.perf_counter() - start, time.process_time() - start_cpu


def engine_decode_steps(model: str, users: int, shared_tokens: int, own_tokens: int,
                        reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Interleaved whole decode steps of ``cpu_paged`` and ``cpu_paged_cascade`` engines: (wall
    seconds, process CPU seconds) per backend."""
    names = ("cpu_paged", "cpu_paged_cascade")
    llms = {name: LLM(model=model, cache="prefix", attention=name, device="cpu", max_num_seqs=max(users, 1))
            for name in names}
    vocab = llms[names[0]].model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(10, vocab - 10, (shared_tokens,), generator=generator).tolist()
    prompts = [shared + torch.randint(10, vocab - 10, (own_tokens,), generator=generator).tolist() for _ in range(users)]
    params = SamplingParams(max_tokens=reps + 8, ignore_eos=True)
    for llm in llms.values():
        llm.add_request(prompts[0], params)
        llm.step()  # the leader's prefill publishes the shared blocks
        for prompt in prompts[1:]:
            llm.add_request(prompt, params)
        while llm.step_records[-1].num_prefill_tokens:  # the others' prefill (prefix hits)
            llm.step()
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(reps):
        for name in names:
            start = time.process_time()
            llms[name].step()
            cpu_times[name].append(time.process_time() - start)
            record = llms[name].step_records[-1]
            if record.num_prefill_tokens or record.num_seqs != users:
                raise RuntimeError(f"expected a decode step of {users} users, got {record}")
            times[name].append(record.duration_s)
    if users >= 2 and not llms["cpu_paged_cascade"].attention.stats.cascade_calls:
        raise RuntimeError("the cascade path never ran: the users do not share prefix blocks")
    return times, cpu_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 8, 16, 30])
    parser.add_argument("--shared-tokens", type=int, default=500)
    parser.add_argument("--own-tokens", type=int, default=24, help="private tokens per user (question + output so far)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    parser.add_argument("--engine", metavar="MODEL", default=None, help="time whole engine decode steps of this model")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine:
        print(f"engine={args.engine} threads={torch.get_num_threads()} shared={args.shared_tokens} own={args.own_tokens}")
        print("| users | cpu_paged step ms | cpu_paged_cascade step ms | speedup | cpu_paged CPU ms "
              "| cpu_paged_cascade CPU ms | CPU-time speedup |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for users in args.users:
            wall, cpu = engine_decode_steps(args.engine, users, args.shared_tokens, args.own_tokens, args.reps)
            p, c = statistics.median(wall["cpu_paged"]), statistics.median(wall["cpu_paged_cascade"])
            pc, cc = statistics.median(cpu["cpu_paged"]), statistics.median(cpu["cpu_paged_cascade"])
            print(f"| {users} | {p * 1e3:.1f} | {c * 1e3:.1f} | {p / c:.2f}x "
                  f"| {pc * 1e3:.1f} | {cc * 1e3:.1f} | {pc / cc:.2f}x |", flush=True)
        return
    plain, cascade = CpuPagedBackend(), CpuPagedCascadeBackend()
    print(f"threads={torch.get_num_threads()} layers={args.layers} heads={args.heads}/{args.kv_heads} "
          f"head_dim={args.head_dim} shared={args.shared_tokens} own={args.own_tokens} block={args.block_size}")
    print("| users | cpu_paged ms | cpu_paged_cascade ms | speedup | cpu_paged CPU ms | cpu_paged_cascade CPU ms "
          "| CPU-time speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for users in args.users:
        caches, metadata = decode_step(users, args.shared_tokens, args.own_tokens, args.block_size,
                                       args.kv_heads, args.head_dim, args.layers)
        generator = torch.Generator().manual_seed(1)
        rows = (torch.randn(users, args.heads, args.head_dim, generator=generator),
                torch.randn(users, args.kv_heads, args.head_dim, generator=generator),
                torch.randn(users, args.kv_heads, args.head_dim, generator=generator))
        scale = args.head_dim ** -0.5
        times: dict[str, list[tuple[float, float]]] = {"plain": [], "cascade": []}
        for rep in range(args.reps + 2):  # two warm-up reps
            for name, backend in (("plain", plain), ("cascade", cascade)):
                seconds = time_step(backend, caches, metadata, rows, scale)
                if rep >= 2:
                    times[name].append(seconds)
        (p, pc), (c, cc) = ([statistics.median(t[i] for t in times[name]) for i in (0, 1)] for name in ("plain", "cascade"))
        print(f"| {users} | {p * 1e3:.2f} | {c * 1e3:.2f} | {p / c:.2f}x | {pc * 1e3:.2f} | {cc * 1e3:.2f} | {pc / cc:.2f}x |")
    print(f"cascade path: {cascade.stats}")


if __name__ == "__main__":
    main()
