#!/usr/bin/env bash
# The GPU check (experiments/bench/gpu_check.py): bash scripts/gpu_check.sh [--out DIR] [--dry-run]
cd "$(dirname "$0")/.." && exec "${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}" -m experiments.bench.gpu_check "$@"
