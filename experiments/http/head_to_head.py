"""Head to head: servelab's server and vLLM's, both measured by ``vllm bench serve``.

The peer benchmark (``+experiment=peer_benchmark``) measures every peer with servelab's own load
client. This command measures on the field's ruler instead: vLLM's own client, its random dataset
and its defaults, against servelab's ``serve.py`` with **no flags** (its default configuration;
``--servelab-override`` adds Hydra overrides) and vLLM's OpenAI server (its CPU build) in each
``--vllm-dtype``. All servers are started first, each on a free 127.0.0.1 port, and stay up; then
each repeat runs every shape (``--input-len`` / ``--output-len``, ``--concurrency``,
``--temperature``) against each server in turn, one ``vllm bench serve`` run each: random
prompts sent as text, ``--ignore-eos``, 4 x c prompts, at most c in flight, the same seed for
every server within a repeat. The server order rotates every repeat, so a machine that slows down
during the run does not favour one server. The servers not being measured are paused (SIGSTOP to
their process groups), so an idle server's threads cannot take cycles from the measured one.

Per shape it reports each server's median over repeats (and range) of output tok/s, TTFT p50 and
TPOT p50, and servelab's median over the faster vLLM's (the dtype with the higher median output
tok/s at that shape). Results: ``head_to_head.json``, ``.md`` and ``.csv`` in ``--out`` (never
overwritten), every ``vllm bench serve`` result and console log beside them, each server's log.

    python -m experiments.http.head_to_head --concurrency 1 8 32 --temperature 0 1 --repeats 3
    python -m experiments.http.head_to_head --input-len 1024 --output-len 128 --concurrency 8 --temperature 0
    python -m experiments.http.head_to_head --servelab-override engine=servelab_f32 --vllm-dtype float32
"""
from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import statistics
import sys
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from experiments.harness.environment import logged_applied_options
from experiments.http.client_agreement import (
    Server,
    Shape,
    check_vllm_bench,
    load_average,
    machine,
    new_results_dir,
    run_vllm_bench,
    start_server,
)
from experiments.http.server_process import ServerProcess
from experiments.peers.vllm_install import cpu_build_python, vllm_version

# vllm_bench.json key -> the name in the report
METRICS = {"output_throughput": "output tok/s", "median_ttft_ms": "TTFT p50 (ms)", "median_tpot_ms": "TPOT p50 (ms)"}
SERVELAB = "servelab"


@dataclass(frozen=True)
class Case:
    """One measured point: a load shape at one sampling temperature."""

    shape: Shape
    temperature: float

    @property
    def name(self) -> str:
        return (f"in{self.shape.input_len}_out{self.shape.output_len}_c{self.shape.concurrency}"
                f"_t{self.temperature:g}")


def cases(input_len: int, output_len: int, concurrencies: list[int], temperatures: list[float]) -> list[Case]:
    """Every (temperature, concurrency) point of one input / output length, in that order."""
    if not concurrencies or not temperatures:
        raise ValueError("give at least one concurrency and one temperature")
    if any(t < 0 for t in temperatures):
        raise ValueError(f"temperatures must be >= 0, got {temperatures}")
    return [Case(Shape(c, input_len, output_len), t) for t, c in itertools.product(temperatures, concurrencies)]


def server_order(labels: list[str], repeat: int) -> list[str]:
    """``labels`` rotated by ``repeat``: each server goes first in turn."""
    shift = repeat % len(labels)
    return labels[shift:] + labels[:shift]


def summarize(runs: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """Per case: each server's median / min / max of :data:`METRICS` over its repeats, the faster
    vLLM (higher median output tok/s) and servelab's medians over that vLLM's."""
    rows = []
    for case in dict.fromkeys(run["case"] for run in runs):
        row: dict[str, Any] = {"case": case, **next(r["shape"] for r in runs if r["case"] == case)}
        for label in labels:
            readings = [r["reading"] for r in runs if r["case"] == case and r["server"] == label and not r["failed"]]
            row[label] = {key: {"median": statistics.median(x[key] for x in readings), "min": min(x[key] for x in readings),
                                "max": max(x[key] for x in readings)} for key in METRICS} if readings else None
            row[label + " runs"] = len(readings)
        vllms = [label for label in labels if label != SERVELAB and row[label] is not None]
        best = max(vllms, key=lambda label: row[label]["output_throughput"]["median"], default=None)
        row["faster vLLM"] = best
        row["ratio"] = ({key: row[SERVELAB][key]["median"] / row[best][key]["median"] for key in METRICS}
                        if best is not None and row[SERVELAB] is not None else None)
        rows.append(row)
    return rows


def _cell(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "failed"
    return f"{stats['median']:.1f} ({stats['min']:.1f}-{stats['max']:.1f})"


def markdown(report: dict[str, Any]) -> str:
    labels = report["servers"]
    lines = [f"# servelab vs vLLM, measured by `vllm bench serve` ({report['vllm_version']})", "",
             f"{report['machine']}; started {report['started']}, ended {report['ended']}; command: "
             f"`{report['command']}`. Random prompts sent as text, --ignore-eos, 4 x c prompts, "
             f"--max-concurrency c; median (min-max) over {report['repeats']} interleaved repeats. "
             f"servelab: serve.py {' '.join(report['servelab_overrides']) or 'with no flags'}, applied "
             f"{json.dumps(report['servelab_applied'])}. Ratio: servelab's median / the faster vLLM's.", ""]
    for key, name in METRICS.items():
        lines += [f"## {name}", "", "| in / out | c | temperature | " + " | ".join(labels) + " | servelab / faster vLLM |",
                  "|" + " --- |" * (len(labels) + 4)]
        for row in report["summary"]:
            ratio = "-" if row["ratio"] is None else f"{row['ratio'][key]:.2f}x ({row['faster vLLM']})"
            cells = " | ".join(_cell(row[label] and row[label][key]) for label in labels)
            lines.append(f"| {row['input_len']} / {row['output_len']} | {row['concurrency']} | {row['temperature']:g} "
                         f"| {cells} | {ratio} |")
        lines.append("")
    loads = [run["loadavg"].split()[0] for run in report["runs"]]
    lines.append(f"1-minute load average before each run: {min(loads)}-{max(loads)}.")
    return "\n".join(lines) + "\n"


def csv_text(report: dict[str, Any]) -> str:
    """One line per run (every repeat of every server and case)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["case", "input_len", "output_len", "concurrency", "temperature", "repeat", "server", "failed",
                     *METRICS, "loadavg"])
    for run in report["runs"]:
        shape = run["shape"]
        writer.writerow([run["case"], shape["input_len"], shape["output_len"], shape["concurrency"], shape["temperature"],
                         run["repeat"], run["server"], run["failed"], *(run["reading"][key] for key in METRICS),
                         run["loadavg"]])
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="max requests in flight")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0], help="sampling temperatures")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (medians over them)")
    parser.add_argument("--vllm-dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32", "auto"],
                        help="one vLLM server per dtype")
    parser.add_argument("--servelab-override", action="append", default=[],
                        help="a Hydra override for serve.py (repeatable); none: its defaults")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="conf/model name, HF folder or .gguf file")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/head_to_head/<time>)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    measured = cases(args.input_len, args.output_len, args.concurrency, args.temperature)
    started = datetime.now(timezone.utc)
    out = new_results_dir(args.out, "head_to_head", started, "head_to_head.json")
    python = cpu_build_python()
    check_vllm_bench(python)
    labels = [SERVELAB] + [f"vLLM {dtype}" for dtype in args.vllm_dtype]
    runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        servers: dict[str, Server] = {}
        processes: dict[str, ServerProcess] = {}
        for label, dtype in zip(labels, ["float32", *args.vllm_dtype]):
            kind = "servelab" if label == SERVELAB else "vllm"
            log_dir = out / label.replace(" ", "_")
            log_dir.mkdir(exist_ok=True)
            print(f"starting {label} ...", flush=True)
            process, servers[label] = start_server(kind, args.model, dtype, python, log_dir,
                                                   servelab_overrides=args.servelab_override)
            stack.callback(process.stop)
            process.pause()
            processes[label] = process
            if kind == "servelab":
                servelab_applied = logged_applied_options(process.log_path)
        for repeat in range(args.repeats):
            for case in measured:
                for label in server_order(labels, repeat):
                    name = f"{case.name}_r{repeat}_{label.replace(' ', '_')}"
                    loadavg = load_average()
                    run = {"case": case.name, "shape": {**asdict(case.shape), "temperature": case.temperature},
                           "repeat": repeat, "server": label, "loadavg": loadavg}
                    processes[label].resume()
                    try:
                        result = run_vllm_bench(python, servers[label], case.shape, repeat, out, name,
                                                temperature=case.temperature)
                    except RuntimeError as error:   # recorded, and the other runs go on
                        run.update(failed=True, error=str(error), reading={key: None for key in METRICS})
                        print(f"{name}: failed: {error}", flush=True)
                    else:
                        run.update(failed=result["failed"] > 0 or result["completed"] == 0,
                                   reading={key: result[key] for key in METRICS})
                        print(f"{name}: " + ", ".join(f"{METRICS[k]} {v:.1f}" for k, v in run["reading"].items())
                              + f"{' (failed requests)' if run['failed'] else ''} (load {loadavg.split()[0]})", flush=True)
                    finally:
                        processes[label].pause()
                    runs.append(run)
    report = {"machine": machine(), "started": started.isoformat(timespec="seconds"),
              "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(["python -m experiments.http.head_to_head", *sys.argv[1:]]),
              "vllm_version": f"vLLM {vllm_version(python)}", "model": args.model, "repeats": args.repeats,
              "servers": labels, "servelab_overrides": args.servelab_override, "servelab_applied": servelab_applied,
              "runs": runs}
    report["summary"] = summarize(runs, labels)
    (out / "head_to_head.json").write_text(json.dumps(report, indent=2))
    (out / "head_to_head.csv").write_text(csv_text(report))
    (out / "head_to_head.md").write_text(markdown(report))
    print(markdown(report))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
