"""The GPU check's dry run on the CPU: its arguments, the one table, the order of the parts and the
exit codes: 0 when every part passes; 1 at a failed part, with the parts after it not run; 2 for
bad arguments (a table already in the output folder is never overwritten)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dry_run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.bench.gpu_check", "--dry-run", "--out", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def statuses(text: str) -> list[tuple[str, str]]:
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")][2:]
    return [(cells[0].strip(), cells[-1].strip()) for cells in rows]


def test_dry_run_passes_every_part_and_writes_the_table(tmp_path):
    proc = dry_run(tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert statuses(proc.stdout) == [("parity", "ok"), ("graphs", "ok"), ("swap", "ok"), ("bench", "ok")]
    assert (tmp_path / "out" / "gpu_check.md").read_text().strip() == proc.stdout.strip()


def test_a_failed_part_stops_the_check_with_exit_1(tmp_path):
    proc = dry_run(tmp_path / "out", "--fail", "graphs")
    assert proc.returncode == 1, proc.stderr
    assert statuses(proc.stdout) == [("parity", "ok"), ("graphs", "FAIL"), ("swap", "not run"), ("bench", "not run")]


def test_bad_arguments_exit_2_and_an_existing_table_is_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu_check.md").write_text("earlier table\n")
    proc = dry_run(out)
    assert proc.returncode == 2 and "exists" in proc.stderr
    assert (out / "gpu_check.md").read_text() == "earlier table\n"
    assert dry_run(tmp_path / "other", "--fail", "nonsense").returncode == 2


def test_greedy_tokens_are_compared_only_where_the_reference_margin_is_clear():
    """A near-tie row (margin 0.001 under a 0.01 tolerance) that flips is not counted; a clear row is."""
    import torch

    from experiments.bench.gpu_check import compare

    reference = torch.tensor([[1.0, 0.999, 0.0], [2.0, 0.0, 0.0]])
    ours = torch.tensor([[0.999, 1.0, 0.0], [2.0, 0.0, 0.001]])
    diff, same, clear = compare(ours, reference, tolerance=0.01)
    assert clear == 1 and same == 1 and abs(diff - 0.001) < 1e-6
    _, same, clear = compare(torch.tensor([[1.0, 0.999, 0.0], [0.0, 2.0, 0.0]]), reference, tolerance=0.01)
    assert clear == 1 and same == 0  # the clear row's token differs: counted as a mismatch


def test_the_parity_comparison_maps_rows_to_prompts_on_the_cpu(tiny_llama_ckpt):
    """The parity part's own functions on the CPU (float32, torch_sdpa, tiny Llama): servelab's
    prefill rows, put back in prompt order, match HF's per-prompt logits; shuffled rows would not."""
    import torch

    from experiments.bench.gpu_check import _engine, _prompts, compare, hf_logits, prefill_logits

    prompts = _prompts(5, seed=3, max_len=40, vocab_size=256)
    ours = prefill_logits(_engine(tiny_llama_ckpt, device="cpu", attention="torch_sdpa", dtype="float32",
                                  block_size=4, capacity_tokens=512), prompts)
    reference = hf_logits(tiny_llama_ckpt, prompts, "float32", device="cpu")
    diff, same, clear = compare(ours, reference, tolerance=1e-4)
    assert diff <= 1e-4 and same == clear > 0
    assert compare(ours.roll(1, dims=0), reference, tolerance=1e-4)[0] > 1e-2
