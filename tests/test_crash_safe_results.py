"""Results you can trust after a crash: files appear whole or not at all, are never replaced, and
the report goes on (listing the broken run) when a run's files are missing or unreadable."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.results.safe_files import write_file, write_text_file

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
TINY = ["model=tiny", "workload=burst", "workload.concurrency=2", "workload.max_max_tokens=12",
        "workload.max_prompt_len=24", "driver.progress=false", "plots=false"]

# Runs run.py in-process after patching Path.write_text so that the process SIGKILLs itself half-way
# through writing job 1's summary.json (whatever name it is written under): a crash mid-write.
DIE_WHILE_WRITING_SUMMARY = """
import os, pathlib, runpy, signal, sys
real_write_text = pathlib.Path.write_text
def write_text(self, data, *args, **kwargs):
    if self.parent.name == "1" and "summary" in self.name and self.suffix == ".json":
        with open(self, "w") as handle:
            handle.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return real_write_text(self, data, *args, **kwargs)
pathlib.Path.write_text = write_text
sys.argv = ["run.py", *sys.argv[1:]]
runpy.run_path("run.py", run_name="__main__")
"""


def test_write_file_never_replaces_and_leaves_no_temporary(tmp_path):
    first = write_text_file("one", tmp_path / "table.md")
    second = write_text_file("two", tmp_path / "table.md")
    assert (first.name, second.name) == ("table.md", "table_1.md")
    assert (first.read_text(), second.read_text()) == ("one", "two")
    assert write_text_file("three", tmp_path / "table.md", replace=True).read_text() == "three"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.md", "table_1.md"]


def test_a_failing_writer_leaves_nothing_under_the_final_name(tmp_path):
    def half_then_fail(partial: Path) -> None:
        partial.write_text("half a fi")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file(tmp_path / "summary.json", half_then_fail)
    assert list(tmp_path.iterdir()) == []


def test_run_killed_while_writing_leaves_no_truncated_file_and_the_report_lists_it(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-c", DIE_WHILE_WRITING_SUMMARY, "-m", *TINY, "scheduler=static,continuous",
         f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]  # SIGKILL: no handler, no cleanup ran
    # every file under a real name is whole: JSON and CSV parse, YAML loads
    for file in sweep.rglob("*"):
        if file.is_file() and not file.name.startswith("."):
            if file.suffix == ".json":
                json.loads(file.read_text())
            elif file.suffix == ".csv":
                pd.read_csv(file)
    assert (sweep / "0" / "summary.json").is_file() and not (sweep / "1" / "summary.json").exists()
    report = subprocess.run([sys.executable, "-m", "experiments.results.report", str(sweep)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    table = pd.read_csv(sweep / "report.csv").set_index("job")
    assert table.loc[0, "status"] == "ok" and table.loc[1, "status"] == "failed"
    assert "job 1: failed: no summary.json" in (sweep / "report.md").read_text()
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    environment = summary["environment"]  # what was applied, and where
    assert environment["device"] == "cpu" and environment["dtype"] == "float32"
    assert {"prepacked", "fused_ops", "native_layers", "kept_freed_memory", "torch", "transformers", "cpu_model", "cpu_count",
            "torch_threads", "skinny_gemm_max_rows", "skinny_gemm_tile_rows", "prefill_dtype", "decode_dtype",
            "onednn_row_buckets", "gpu"} <= set(environment)
    assert environment["gpu"]["index"] is None and "torch_cuda" in environment["gpu"]  # a CPU run: no device
    assert isinstance(environment["prepacked"], bool) and environment["git"]["commit"]


def test_report_lists_runs_with_unreadable_files_and_goes_on(tmp_path):
    good = {"status": "ok", "error": None, "run": {"engine": "servelab", "scheduler": "continuous"},
            "metrics": {"output_throughput": 10.0, "ttft_s_p50": 0.5}}
    for job in ("0", "1", "2"):
        (tmp_path / job).mkdir()
    (tmp_path / "0" / "summary.json").write_text(json.dumps(good))
    (tmp_path / "0" / "requests.csv").write_text("request_id,ttft_s\nreq-0,0.5\n")
    (tmp_path / "1" / "summary.json").write_text(json.dumps(good)[:40])  # truncated by an older crash
    (tmp_path / "2" / "summary.json").write_text(json.dumps({**good, "run": {"scheduler": "static"}}))
    (tmp_path / "2" / "requests.csv").write_bytes(b"request_id,ttft_s\n\"req-0,0.5\n\xff\xfe")  # damaged CSV
    from experiments.results.report import write_report

    csv_path, md_path, *_ = write_report(tmp_path)
    table = pd.read_csv(csv_path).set_index("job")
    assert list(table["status"]) == ["ok", "unreadable", "ok"]
    text = md_path.read_text()
    assert "job 1: unreadable: unreadable summary.json (JSONDecodeError" in text
    assert "job 2: unreadable requests.csv" in text and "3 runs, 1 failed or unreadable" in text


def test_roofline_never_overwrites_an_earlier_one(tmp_path, monkeypatch):
    """A second roofline into the same folder writes roofline_1.csv / .md and leaves the first
    one's files byte for byte. The machine probes are stubbed (what is under test is the files;
    tests/test_optimizations.py runs the probes), each run with its own numbers."""
    from experiments.bench import roofline

    args = ["--model", "tiny", "--batch-sizes", "1", "--context", "8", "--steps", "1", "--prepack", "false",
            "--attention", "torch_sdpa", "--out", str(tmp_path)]
    monkeypatch.setattr(roofline, "measure_matmul_peak", lambda device, dtype: 200e9)  # FLOP/s
    monkeypatch.setattr(roofline, "measure_bandwidth", lambda device: (20e9, 25e9))  # bytes/s: copy, read
    roofline.main(args)
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(first) == ["roofline.csv", "roofline.md"]
    monkeypatch.setattr(roofline, "measure_bandwidth", lambda device: (30e9, 35e9))
    roofline.main(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["roofline.csv", "roofline.md", "roofline_1.csv", "roofline_1.md"]
    assert all((tmp_path / name).read_bytes() == data for name, data in first.items())
    assert "35.0 GB/s" in (tmp_path / "roofline_1.md").read_text()  # the second run's own numbers
