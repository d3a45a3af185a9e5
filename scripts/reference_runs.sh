#!/usr/bin/env bash
# Re-creates results/reference/: every experiment of conf/experiment/ on
# model=smollm2-135m (the SmolLM2-135M architecture, random weights, float32; length-controlled
# workloads with ignore_eos), one after another, plus the roofline probe; peer_benchmark runs on
# the real model (smollm2-135m-instruct, its GGUF weights: llama.cpp serves the same file).
# Usage: scripts/reference_runs.sh [experiment ...]   (default: all). An existing folder is kept:
# remove it first to rerun (nothing is overwritten silently).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=results/reference
experiments=("$@")
[ ${#experiments[@]} -gt 0 ] || experiments=(naive_vs_continuous squeezed_pool prefix_sharing memory_pressure
  block_size_sweep decode_scaling concurrency_sweep peer_benchmark roofline)
mkdir -p "$OUT"
# One line per experiment run (appended, never overwritten); each summary.json also records its environment.
machine="$(nproc) CPU cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), no GPU, torch $($PY -c 'import torch; print(torch.__version__)')"
for name in "${experiments[@]}"; do
  if [ -e "$OUT/$name" ]; then echo "skip $name: $OUT/$name exists"; continue; fi
  echo "=== $name $(date -u +%T)"
  echo "$name: $(date -u '+%F %T') UTC, $machine, load average $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/MACHINE.txt"
  if [ "$name" = roofline ]; then
    $PY -m experiments.bench.roofline --out "$OUT/roofline"
  elif [ "$name" = peer_benchmark ]; then
    $PY run.py +experiment="$name" hydra.sweep.dir="$OUT/$name" driver.progress=false
  else
    $PY run.py +experiment="$name" model=smollm2-135m hydra.sweep.dir="$OUT/$name" driver.progress=false
  fi
done
