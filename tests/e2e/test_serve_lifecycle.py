"""`pagoda serve` never leaves its services behind (issue 16): not when it is killed with
SIGKILL, not when its output pipe is gone before Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wiring.launcher import free_port


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


def _start(model_dir: str, tmp: Path, stdout) -> tuple[subprocess.Popen, list[int]]:
    ready = tmp / "ready.json"
    cmd = [
        sys.executable,
        "-m",
        "wiring.cli",
        "serve",
        "--model",
        model_dir,
        "--port",
        str(free_port()),
        "--grpc-port",
        str(free_port()),
        "--num-kv-blocks",
        "64",
        "--num-threads",
        "1",
        "--grace-period",
        "1",
        "--log-dir",
        str(tmp / "logs"),
        "--ready-file",
        str(ready),
    ]
    serve = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while not ready.exists():
        assert serve.poll() is None, "pagoda serve exited before it was ready"
        assert time.monotonic() < deadline, "pagoda serve not ready after 180 s"
        time.sleep(0.2)
    children = [int(p) for t in Path(f"/proc/{serve.pid}/task").iterdir() for p in (t / "children").read_text().split()]
    assert len(children) == 4  # KV service, one stage, scheduler, gateway
    return serve, children


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":  # a zombie has exited (its new parent reaps it)
            out.append(pid)
    return out


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _alive(pids)
    for pid in left:
        os.kill(pid, signal.SIGKILL)  # (do not leave them to the next test)
    return left


def test_sigkill_of_serve_leaves_no_service_behind(model_dir, tmp_path):
    serve, children = _start(model_dir, tmp_path, subprocess.DEVNULL)
    serve.kill()
    serve.wait(10)
    assert _gone_within(children, 2.0) == []


def test_ctrl_c_after_its_output_pipe_closed_still_stops_every_service(model_dir, tmp_path):
    serve, children = _start(model_dir, tmp_path, subprocess.PIPE)
    serve.stdout.close()  # `pagoda serve | tee log` with tee gone: the next print breaks the pipe
    os.kill(serve.pid, signal.SIGINT)
    assert serve.wait(60) == 0  # it shut down as asked, not on a BrokenPipeError
    assert _gone_within(children, 2.0) == []
    log = (tmp_path / "logs" / "gateway.log").read_text()
    assert "Traceback" not in log
    assert json.loads((tmp_path / "ready.json").read_text())["workers"]
