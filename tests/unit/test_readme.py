"""The README and docs as a new user meets them: every relative link resolves, and the
README's Python example runs as written (the default model `make run` serves, fetched and
prepared in a private cache folder)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from support.caches import private_cache_with_shared_kernels

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_resolves_inside_the_repository():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists() or REPO_ROOT not in path.parents:
                broken.append(f"{doc.relative_to(REPO_ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_python_example_runs(tmp_path):
    """In a private cache folder: the model is fetched and its GGUF folder prepared as on a
    new user's first run; only the machine's native kernels and their calibration are the
    shared cache's (support/caches.py: built again here they took ~25 s of the ~45)."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
    assert blocks
    cache = private_cache_with_shared_kernels(tmp_path)
    env = {**os.environ, "PAGODA_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    for code in blocks:
        done = subprocess.run(
            [sys.executable, "-c", "import torch; torch.set_num_threads(1)\n" + code],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip(), "the example prints the generated text"
