"""The walls between the parts: the torch-free services start fast and light."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    ["scheduler_svc.server", "scheduler_svc.transport", "kvcache_svc.server", "services.text",
     "services.launcher", "services.cli", "gateway.app", "gateway.server"],
)
def test_does_not_import_torch(module):
    code = f"import sys, {module}; bad = [m for m in ('torch', 'transformers', 'worker_svc') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_worker_does_not_import_the_scheduler():
    code = "import sys, worker_svc.server; sys.exit(1 if any(m.startswith('scheduler_svc') for m in sys.modules) else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
