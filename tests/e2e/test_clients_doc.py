"""Every recipe of docs/clients.md marked `<!-- run -->` runs against a live `pagoda serve`
(the tiny model served as `tiny`), with the documented ports replaced by the test's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wiring.launcher import ServiceProcess, free_port, pagoda_command

DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
BLOCK = re.compile(r"<!-- run -->\n```(bash|python)\n(.*?)```", re.S)
RECIPES = [(lang, code) for lang, code in BLOCK.findall(DOC.read_text())]


def test_the_doc_has_its_recipes():
    assert [lang for lang, _ in RECIPES].count("python") >= 5 and len(RECIPES) >= 7


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("clients-stack-logs")
    port, grpc_port = free_port(), free_port()
    serve = ServiceProcess(
        "serve",
        pagoda_command("serve", model_factory(arch="llama"), "--port", str(port), "--grpc-port", str(grpc_port),
                       "--num-kv-blocks", "128", "--num-threads", "1", "--max-model-len", "512",
                       "--served-model-name", "tiny", "--log-dir", str(logs)),
        f"127.0.0.1:{grpc_port}", log_path=logs / "serve.log",
    )
    serve.start()
    try:
        serve.wait_healthy(180)
    except Exception:
        serve.stop()
        raise
    yield port, grpc_port
    serve.stop(60)


@pytest.mark.parametrize(("lang", "code"), RECIPES, ids=[f"{i}-{lang}" for i, (lang, _) in enumerate(RECIPES)])
def test_recipe_runs(stack, lang, code, tmp_path):
    port, grpc_port = stack
    code = code.replace("localhost:8000", f"127.0.0.1:{port}").replace("localhost:50051", f"127.0.0.1:{grpc_port}")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HOME": str(tmp_path)}  # no user configuration of any client library leaks in
    command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), done.stderr
