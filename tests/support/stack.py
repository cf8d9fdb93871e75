"""A `pagoda serve` stack for tests that kill, stop and overload its processes: start it, find
each service's process (they are restarted with new pids), read its KV statistics, tear it
down at once."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from wiring.launcher import ServiceProcess, free_port, pagoda_command


@dataclass
class Stack:
    serve: ServiceProcess
    port: int
    grpc_port: int
    logs: Path
    ready: dict
    api_key: str | None = None  # sent with the stack's own reads when keys are on

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def service_pid(self, kind: str, stage: int | None = None) -> int:
        """The live process of a service ("gateway", "scheduler", "kvcache", "worker")."""
        for pid, argv in children(self.serve.process.pid).items():
            if len(argv) > 3 and argv[1:3] == ["-m", "wiring.cli"] and argv[3] == kind:
                if stage is None or f"--stage={stage}" in argv or _flag(argv, "--stage") == str(stage):
                    return pid
        raise LookupError(f"no {kind} process under pagoda serve ({self.serve.process.pid})")

    def get(self, path: str, timeout: float = 10.0) -> dict:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(f"{self.url}{path}", headers=headers)
        return json.loads(urllib.request.urlopen(request, timeout=timeout).read())

    def kv_used_blocks(self, retry_s: float = 10.0) -> int:
        """The KV service's used blocks, through the gateway; a 5xx while the stack recovers
        from a fault (statistics bounded by the gateway's 2 s deadline) is asked again."""
        deadline = time.time() + retry_s
        while True:
            try:
                return self.get("/debug/memory")["kv_cache"]["num_used_blocks"]
            except urllib.error.HTTPError as exc:
                if exc.code < 500 or time.time() > deadline:
                    raise
                time.sleep(0.2)

    def wait_serving(self, timeout_s: float) -> float:
        """Seconds until /health says ok (the whole chain serving)."""
        start = time.time()
        while time.time() - start < timeout_s:
            try:
                if urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200:
                    return time.time() - start
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"not serving again within {timeout_s} s")

    def stop(self) -> None:
        """Tears the stack down at once (`kill_tree`). No test asserts the graceful drain
        here (3-7 s a stack, one service after another); `stop_gracefully` has it."""
        kill_tree(self.serve)

    def stop_gracefully(self) -> None:
        """SIGTERM: `pagoda serve` drains and stops its services one after another."""
        self.serve.stop(60)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else None


def children(parent: int) -> dict[int, list[str]]:
    """Live child processes of `parent`: pid -> argv (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                out[int(entry.name)] = [a.decode() for a in argv if a]
        except (OSError, ValueError, IndexError):
            continue
    return out


def start_serve(
    model_dir: str | None, log_dir: Path, *args: str, env: dict | None = None, timeout_s: float = 180
) -> Stack:
    """`pagoda serve model_dir ...` (None: no model named, the default model)."""
    port, grpc_port = free_port(), free_port()
    ready = log_dir / "ready.json"
    model = [] if model_dir is None else [model_dir]
    serve = ServiceProcess(
        "serve",
        pagoda_command(
            "serve",
            *model,
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--log-dir",
            str(log_dir),
            "--ready-file",
            str(ready),
            *args,
        ),
        f"127.0.0.1:{grpc_port}",
        log_path=log_dir / "serve.log",
        env=env or {},
    )
    serve.start()
    try:
        serve.wait_healthy(timeout_s)
        for _ in range(100):
            if ready.exists():
                break
            time.sleep(0.1)
        return Stack(serve, port, grpc_port, log_dir, json.loads(ready.read_text()))
    except Exception:
        serve.stop()
        raise


def kill_tree(process: ServiceProcess) -> None:
    """SIGKILL to a started service (`pagoda serve` or one service) and to every process under
    it (each service is a session of its own), then waits until they are gone: a test's
    teardown at once, where the graceful stop is not what is tested."""
    if process.process is None:
        return
    tree = descendants(process.process.pid)
    process.kill()
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass
    deadline = time.time() + 10
    while any(_running(pid) for pid in tree) and time.time() < deadline:
        time.sleep(0.02)


def kill_stack(stack) -> None:
    """`kill_tree` for every process of a `wiring.launcher.Stack` (its `stop` stops them one
    after another, ~2 s a stack), where the graceful stop is not what is tested."""
    for process in stack.processes:
        kill_tree(process)


def descendants(parent: int) -> list[int]:
    """Every live process under `parent`, children first."""
    out, queue = [], [parent]
    while queue:
        kids = list(children(queue.pop()))
        out += kids
        queue += kids
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init, not by us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def profile() -> str:
    """`PAGODA_CHAOS_PROFILE`: "quick" (make test) or "long" (make chaos)."""
    return os.environ.get("PAGODA_CHAOS_PROFILE", "quick")
