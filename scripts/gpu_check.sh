#!/usr/bin/env bash
# One-shot check and measurement of Pagoda's GPU path (Triton kernels, CUDA runtime, FP8),
# for a prepared GPU image: its own python3 with torch, triton and transformers, no network,
# no project virtualenv. Runs from the repository root with PYTHONPATH=.; writes its figures
# to $OUT/gpu_check.json (or ./gpu_check.json) after every part; exits non-zero on any
# failure. See scripts/gpu_check.py for the parts.
#
#   scripts/gpu_check.sh                 # on the GPU machine (under six minutes)
#   scripts/gpu_check.sh --cpu-smoke     # here: every part on the CPU, interpreter, toy sizes
#   PYTHON=.venv/bin/python scripts/gpu_check.sh --cpu-smoke
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Each part has its own timeout inside; this one only guards the driver itself.
exec timeout -k 10 370 "${PYTHON:-python3}" scripts/gpu_check.py "$@"
