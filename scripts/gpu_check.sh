#!/usr/bin/env bash
# The GPU path end to end (scripts/gpu_check.py's doc): run on a machine with a CUDA device, a few minutes.
#   scripts/gpu_check.sh [--sessions N] [--keep DIR]
# Needs a venv with the gpu and train extras: pip install -e '.[gpu,train]' (a CUDA build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "gpu_check: nvidia-smi not found" >&2
exec "$python" scripts/gpu_check.py "$@"
