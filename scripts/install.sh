#!/usr/bin/env bash
# Install megamoe (editable) with its test extra. torch: an installed one is kept (GPU machines bring their own
# CUDA build); otherwise a machine with an NVIDIA GPU gets the default (CUDA) build and a CPU-only machine
# torch==2.13.0, the CPU build that lies on these machines' disk (fast, no multi-GB CUDA download).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PYTHON" -m pip install torch
  else
    "$PYTHON" -m pip install "torch==2.13.0"
  fi
fi
"$PYTHON" -m pip install -e ".[test]"
