#!/usr/bin/env bash
# One-shot check and measurement of Pagoda's GPU path (Triton kernels, CUDA runtime, FP8),
# for a prepared GPU image: its own python3 with torch, triton and transformers, no network,
# no project virtualenv. Runs from the repository root with PYTHONPATH=.; writes its figures
# to $OUT/gpu_check.json (or ./gpu_check.json) after every part; exits non-zero on any
# failure. See scripts/gpu_check.py for the parts. Then the fused mixture-of-experts kernel
# (tests/gpu/moe_check.py): checked against the torch path and timed at a Qwen3-MoE-30B-A3B
# layer's shape, figures in $OUT/gpu_moe.json; it runs whatever the first step's outcome.
# Then the data plane's GPU channels (tests/gpu/p2p_check.py, issue 37): the NCCL link between
# two GPUs (with one GPU: the fallback to the shared-memory ring), bit-exact hand-offs timed,
# figures in $OUT/gpu_p2p.json.
#
#   scripts/gpu_check.sh                 # on the GPU machine (under eight minutes)
#   scripts/gpu_check.sh --cpu-smoke     # here: every part on the CPU, interpreter, toy sizes
#   PYTHON=.venv/bin/python scripts/gpu_check.sh --cpu-smoke
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
status=0
# Each part has its own timeout inside; this one only guards the driver itself.
timeout -k 10 370 "$python" scripts/gpu_check.py "$@" || status=$?
moe_args=()
for arg in "$@"; do
    if [[ $arg == --cpu-smoke ]]; then moe_args+=(--cpu-smoke); fi
done
echo "== fused_moe (timeout 120 s)"
timeout -k 10 120 "$python" tests/gpu/moe_check.py ${moe_args[@]+"${moe_args[@]}"} || status=$?
echo "== stage data plane: NCCL link / shared-memory ring (timeout 90 s)"
timeout -k 10 90 "$python" tests/gpu/p2p_check.py ${moe_args[@]+"${moe_args[@]}"} || status=$?
exit "$status"
