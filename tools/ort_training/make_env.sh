#!/usr/bin/env bash
# Makes the separate virtual environment that generates the onnxruntime-training fixtures.
# It cannot be the project's venv: onnxruntime-training and onnxruntime both provide the
# `onnxruntime` module. Versions are pinned exactly (DESIGN.md section 9): onnx 1.17 writes an
# IR version onnxruntime-training 1.19 accepts, and torch 2.13.0 is the one local CPU build
# (any other torch version downloads gigabytes).
# Usage: tools/ort_training/make_env.sh [VENV_DIR]   (default: $ORTT_VENV or /work/ortt-venv)
set -euo pipefail
venv="${1:-${ORTT_VENV:-/work/ortt-venv}}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/pip" install -q \
    'onnxruntime-training==1.19.2' 'onnx==1.17.0' 'numpy<2' 'torch==2.13.0'
"$venv/bin/python" - <<'PY'
import numpy, onnx, onnxruntime, torch
print("onnxruntime", onnxruntime.__version__, "onnx", onnx.__version__,
      "numpy", numpy.__version__, "torch", torch.__version__)
PY
