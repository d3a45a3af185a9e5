"""The GPU check: one command, at most 8 minutes on one GPU, that stops at the first failure.

    python -m experiments.bench.gpu_check [--out results/reference/gpu_check] [--dry-run]

Parts, in order, each with its own time-out (their sum is 450 s, inside the 8 minutes):

1. ``parity`` (120 s): last-row prefill logits of servelab against HF ``transformers`` on the same
   random Llama (GQA, head_dim 64), on CUDA, for ``torch_sdpa``, ``eager`` and ``triton_paged`` in
   float32 and bfloat16. Logits must agree within a tolerance per dtype; the greedy token is
   compared only on rows whose HF top-2 margin is wider than twice that tolerance (a near-tie may
   legitimately flip between kernels that sum in a different order).
2. ``graphs`` (60 s): ``triton_paged`` with CUDA graphs on against off: the first decode step's
   logits within the float32 tolerance (a replay must compute what the eager step computes).
3. ``swap`` (60 s): swap preemption under a squeezed KV pool serves the same greedy tokens as an
   unsqueezed run, and swapped at least once.
4. ``bench`` (210 s): Qwen2.5-0.5B (random weights) in bfloat16, burst workload at c = 64 and 256,
   servelab against HF ``generate_batch`` (``hf_continuous``): output tokens/s per engine, through
   ``run.py`` into the output folder. It fails if any job fails.

It prints one table (part, case, measured, limit, status) and writes it to ``OUT/gpu_check.md``
(``OUT`` is ``--out``; an existing table is never overwritten: the check refuses to start).
Exit status: 0 when every part passed, 1 at the first failed part (later parts are listed as not
run), 2 for bad arguments.

``--dry-run`` runs on the CPU everything but the GPU work: the arguments, the parts' order and
time-outs, the table and the exit codes; each part reports "dry run" instead of a measurement.
``--fail PART`` makes that part fail (with ``--dry-run``), to check the stop-and-exit path.
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {"float32": 2e-3, "bfloat16": 0.25}  # max |logit difference| against HF, per dtype
PARITY_MODEL = {  # small GQA Llama: 8 query heads on 2 KV heads, head_dim 64 (a real kernel tile size)
    "model_type": "llama", "vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}


@dataclass
class Row:
    """One line of the table."""

    part: str
    case: str
    measured: str
    limit: str
    ok: bool | None  # None: not run


@dataclass
class Part:
    name: str
    timeout_s: int
    run: Callable[[Path], list[Row]]


class PartTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise :class:`PartTimeout` in the main thread after ``seconds`` (SIGALRM)."""
    def expire(signum, frame):
        raise PartTimeout(f"past its {seconds} s time-out")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _prompts(count: int, seed: int = 0, max_len: int = 200, vocab_size: int = PARITY_MODEL["vocab_size"]) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(8, max_len))] for _ in range(count)]


def _checkpoint(folder: Path) -> Path:
    from engine.loader import build_random_checkpoint

    return build_random_checkpoint(PARITY_MODEL, folder / "parity_llama", seed=0)


def _engine(ckpt: Path, **options):
    from engine import LLM

    settings = dict(device="cuda", block_size=16, capacity_tokens=16384, max_num_seqs=16)
    settings.update(options)
    return LLM(model=str(ckpt), **settings)


def prefill_logits(llm, prompts: list[list[int]]):
    """Float32 next-token logits of each prompt's last row, in prompt order, from one servelab step."""
    from engine import SamplingParams

    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    inputs = llm.runner.prepare(llm.scheduler.schedule().scheduled)
    logits = llm.runner.execute(inputs).float().cpu()
    order = {tuple(item.seq.prompt_token_ids): row for row, item in enumerate(inputs.sampled)}
    return logits[[order[tuple(p)] for p in prompts]]


def hf_logits(ckpt: Path, prompts: list[list[int]], dtype: str, device: str = "cuda"):
    """HF ``transformers``' last-row logits per (unpadded) prompt, as float32 on the host."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=getattr(torch, dtype)).to(device).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p], device=device)).logits[0, -1].float().cpu() for p in prompts])


def compare(ours, reference, tolerance: float) -> tuple[float, int, int]:
    """(max |difference|, greedy tokens equal, rows whose reference top-2 margin > 2 x tolerance)."""
    diff = (ours - reference).abs().max().item()
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance
    same = (ours.argmax(-1) == reference.argmax(-1)) & clear
    return diff, int(same.sum()), int(clear.sum())


def run_parity(out: Path) -> list[Row]:
    rows = []
    prompts = _prompts(12)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        ckpt = _checkpoint(Path(folder))
        for dtype, tolerance in TOLERANCE.items():
            reference = hf_logits(ckpt, prompts, dtype)
            for attention in ("torch_sdpa", "eager", "triton_paged"):
                ours = prefill_logits(_engine(ckpt, attention=attention, dtype=dtype), prompts)
                diff, same, clear = compare(ours, reference, tolerance)
                rows.append(Row("parity", f"{attention} {dtype} vs HF", f"max|dlogit| {diff:.2e}; greedy {same}/{clear}",
                                f"<= {tolerance:g}; all clear rows", math.isfinite(diff) and diff <= tolerance
                                and same == clear))
    return rows


def run_graphs(out: Path) -> list[Row]:
    from engine import SamplingParams

    prompts = _prompts(8, seed=1, max_len=100)  # 800 tokens at most: one prefill step, then decodes
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        ckpt = _checkpoint(Path(folder))
        logits = []
        for graphs in (False, True):
            llm = _engine(ckpt, attention="triton_paged", dtype="float32", cuda_graphs=graphs)
            for prompt in prompts:
                llm.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            llm.step()  # the prefill; the next step is one-token rows (a graph replay when on)
            inputs = llm.runner.prepare(llm.scheduler.schedule().scheduled)
            replayed = llm.runner.graphs is not None and llm.runner.graphs.can_run(inputs.metadata)
            logits.append((llm.runner.execute(inputs).float().cpu(), replayed))
        (off, _), (on, replayed) = logits
        diff = (on - off).abs().max().item()
        tolerance = TOLERANCE["float32"]
        return [Row("graphs", "triton_paged decode, graphs on vs off", f"max|dlogit| {diff:.2e}; replayed {replayed}",
                    f"<= {tolerance:g}; replayed", replayed and diff <= tolerance)]


def run_swap(out: Path) -> list[Row]:
    from engine import SamplingParams

    prompts = _prompts(16, seed=2)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        ckpt = _checkpoint(Path(folder))
        roomy = _engine(ckpt, attention="torch_sdpa", dtype="float32")
        expected = [o.token_ids for o in roomy.generate(prompts, [params] * len(prompts))]
        squeezed = _engine(ckpt, attention="torch_sdpa", dtype="float32", scheduler="preemptive", capacity_tokens=1024,
                           scheduler_options={"preemption_mode": "swap", "swap_space_tokens": 8192})
        got = [o.token_ids for o in squeezed.generate(prompts, [params] * len(prompts))]
        swapped = squeezed.cache.stats().swap_out_blocks
        same = sum(a == b for a, b in zip(got, expected))
        return [Row("swap", "preemptive swap, 1,024-token pool", f"tokens equal {same}/{len(prompts)}; "
                    f"blocks swapped out {swapped}", f"{len(prompts)}/{len(prompts)}; > 0",
                    same == len(prompts) and swapped > 0)]


def run_bench(out: Path) -> list[Row]:
    sweep = out / "peer_benchmark"
    command = [sys.executable, "run.py", "-m", "+experiment=peer_benchmark", "+serving=servelab_best,hf_continuous",
               "attention=torch_sdpa", "model=qwen2.5-0.5b", "dtype=bfloat16", "device=cuda", "plots=false",
               "driver.progress=false", "workload.concurrency=64,256", "scheduler.max_num_seqs=256",
               "cache.capacity_tokens=131072", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    (out / "peer_benchmark.log").write_text(proc.stdout + proc.stderr)
    rows = []
    for summary in sorted(sweep.glob("*/summary.json")):
        data = json.loads(summary.read_text())
        run, metrics = data.get("run", {}), data.get("metrics", {})
        rows.append(Row("bench", f"{run.get('engine', summary.parent.name)} c={run.get('concurrency')}",
                        f"{metrics.get('output_throughput', float('nan')):.0f} tok/s", "finished", True))
    if proc.returncode != 0 or not rows:
        rows.append(Row("bench", "run.py peer_benchmark", f"exit {proc.returncode}", "exit 0", False))
    return rows


PARTS = [Part("parity", 120, run_parity), Part("graphs", 60, run_graphs), Part("swap", 60, run_swap),
         Part("bench", 210, run_bench)]


def dry(part: Part, fail: str | None) -> Callable[[Path], list[Row]]:
    """The CPU stand-in for a part: no GPU work, a "dry run" row, failed when ``--fail`` names it."""
    return lambda out: [Row(part.name, "dry run", "-", f"time-out {part.timeout_s} s", part.name != fail)]


def table(rows: list[Row]) -> str:
    status = {True: "ok", False: "FAIL", None: "not run"}
    lines = ["| part | case | measured | limit | status |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.part} | {r.case} | {r.measured} | {r.limit} | {status[r.ok]} |" for r in rows]
    return "\n".join(lines)


def check(out: Path, dry_run: bool, fail: str | None) -> int:
    """Run the parts in order, stop at the first failure; print and write the table; the exit status."""
    rows: list[Row] = []
    failed = False
    for part in PARTS:
        if failed:
            rows.append(Row(part.name, "-", "-", f"time-out {part.timeout_s} s", None))
            continue
        run = dry(part, fail) if dry_run else part.run
        try:
            with time_limit(part.timeout_s):
                part_rows = run(out)
        except Exception as error:  # a part that raises or runs past its time-out fails, with the reason
            part_rows = [Row(part.name, "error", f"{type(error).__name__}: {error}", f"time-out {part.timeout_s} s",
                             False)]
        rows += part_rows
        failed = any(r.ok is False for r in part_rows)
    text = table(rows)
    print(text)
    (out / "gpu_check.md").write_text(text + "\n")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results/reference/gpu_check",
                        help="folder for gpu_check.md and the benchmark's runs (must not hold a gpu_check.md)")
    parser.add_argument("--dry-run", action="store_true", help="everything but the GPU work (runs on the CPU)")
    parser.add_argument("--fail", choices=[p.name for p in PARTS], help="with --dry-run: make this part fail")
    args = parser.parse_args(argv)
    if args.fail and not args.dry_run:
        parser.error("--fail only goes with --dry-run")
    if (args.out / "gpu_check.md").exists():
        parser.error(f"{args.out / 'gpu_check.md'} exists: choose another --out (a table is never overwritten)")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device: the check needs one (--dry-run runs the rest on the CPU)")
    args.out.mkdir(parents=True, exist_ok=True)
    return check(args.out, args.dry_run, args.fail)


if __name__ == "__main__":
    sys.exit(main())
