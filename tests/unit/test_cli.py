"""The `pagoda` command line, run as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def pagoda(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_tiny_model_command(tmp_path):
    out = tmp_path / "m"
    done = pagoda("tiny-model", str(out), "--arch", "qwen2", "--num-layers", "2")
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_hidden_layers"] == 2
    again = pagoda("tiny-model", str(out))
    assert again.returncode == 1 and "--overwrite" in again.stderr
    bad = pagoda("tiny-model", str(tmp_path / "x"), "--num-heads", "3")
    assert bad.returncode == 2 and "num_heads" in bad.stderr


def test_serve_makes_the_default_model_and_says_what_it_serves(tmp_path):
    done = pagoda("serve", env={"PAGODA_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "LlamaForCausalLM" in done.stdout and str(tmp_path) in done.stdout
    assert list(tmp_path.glob("models/*/config.json"))
