"""`make install` resolves, as pip would install it on this machine, to a working set without
CUDA packages: torch by `scripts/install_torch.sh` (the CPU build without a GPU), then the
project with its development extras under `requirements/constraints.txt`, in one dry run.

A conflict between the pins (as `python-dateutil` against a new development dependency once
was) fails here instead of on the next fresh machine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with a GPU keeps CUDA torch")
def test_make_install_resolves_without_cuda(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "install_torch.sh"),
            sys.executable,
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            "-c",
            str(ROOT / "requirements" / "constraints.txt"),
            "-e",
            f"{ROOT}[dev]",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    installs = {
        i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    cuda = sorted(n for n in installs if n.startswith(("nvidia-", "cuda-")) or "cuda" in n)
    assert cuda == [], f"CUDA packages on a machine without a GPU: {cuda}"
    assert installs["torch"].startswith("2.13.0")
    assert {"pagoda", "llguidance", "grpcio", "transformers", "playwright"} <= set(installs)
