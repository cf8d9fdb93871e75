#!/usr/bin/env bash
# Installs torch for `make install`: a user with a GPU keeps the torch they have (or gets the
# default build); without one, the CPU build 2.13.0, from PyTorch's CPU index where it can
# be reached (the public index's Linux wheel would pull multi-GB CUDA packages), else from
# the indexes pip is configured with.
#
#   scripts/install_torch.sh PYTHON [extra pip arguments]
#
# With extra arguments (e.g. --dry-run --ignore-installed --report FILE, as
# tests/unit/test_install.py runs it) it resolves even where torch is installed already.
set -euo pipefail
py=$1; shift
version=2.13.0
cpu_index=https://download.pytorch.org/whl/cpu
if [ $# -eq 0 ] && "$py" -c "import torch" 2>/dev/null; then exit 0; fi
if command -v nvidia-smi >/dev/null 2>&1; then
	exec "$py" -m pip install -q torch "$@"
elif "$py" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" 2>/dev/null; then
	exec "$py" -m pip install -q "torch==$version" --extra-index-url "$cpu_index" "$@"
else
	exec "$py" -m pip install -q "torch==$version" "$@"
fi
