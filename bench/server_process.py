"""One benchmarked server process, and every process it starts, from start to a clean stop.

`Server` starts a command in its own session and tracks its descendants through /proc (keyed
by pid and start time, so a reused pid is another process); `stop` sends SIGTERM to the group,
then SIGKILL to every group it saw, and says which pids survived. `run_on_server` runs one
piece of work against a healthy server and always stops it. Used by bench.vs_vllm and
bench.vs_llama_cpp, one server at a time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

ProcKey = tuple[int, int]  # (pid, start time in clock ticks): a pid reused later is another key


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, start time) of a live process from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie is dead, only not yet reaped
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def _alive(key: ProcKey) -> bool:
    st = _stat(key[0])
    return st is not None and st[2] == key[1]


def _descendants(root: int) -> set[ProcKey]:
    """The live processes below `root` (children, theirs, ...), from /proc."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append((int(entry), st[2]))
    out: set[ProcKey] = set()
    todo = [root]
    while todo:
        for pid, start in children.get(todo.pop(), ()):
            if (pid, start) not in out:
                out.add((pid, start))
                todo.append(pid)
    return out


class Server:
    """One server process in its own session, with every process it starts tracked, so that
    `stop` can reach services that put themselves in sessions of their own."""

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str], log_path: Path, base_url: str, cwd: Path = REPO_ROOT
    ) -> None:
        self.name = name
        self.cwd = cwd
        self.cmd = cmd
        self.env = env
        self.log_path = log_path
        self.base_url = base_url
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: set[ProcKey] = set()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                cwd=self.cwd,
            )
        st = _stat(self.proc.pid)
        if st is not None:
            self.seen.add((self.proc.pid, st[2]))

    def track(self) -> None:
        """Note the processes the server has started so far."""
        if self.proc is not None and self.proc.poll() is None:
            self.seen |= _descendants(self.proc.pid)

    def pids(self) -> list[int]:
        self.track()
        return [pid for pid, _ in self.seen]

    def log_tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll GET /health until 200; seconds it took. Raises if the server exits or is late."""
        import httpx2

        assert self.proc is not None
        t0 = time.perf_counter()
        with httpx2.Client(timeout=5.0) as http:
            while True:
                self.track()
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode} before it "
                        f"was healthy; log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if http.get(f"{self.base_url}/health").status_code == 200:
                        self.track()
                        return time.perf_counter() - t0
                except httpx2.HTTPError:
                    pass
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(
                        f"{self.name} not healthy after {timeout_s:.0f}s; log {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(1.0)

    def stop(self, term_wait_s: float = 45.0) -> list[int]:
        """SIGTERM the process group and wait; then SIGKILL the group and every process the
        server started (each in its own group too). Returns the pids still alive after that."""
        if self.proc is None:
            return []
        self.track()
        leader = self.proc.pid
        if self.proc.poll() is None:
            try:
                os.killpg(leader, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + term_wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not any(_alive(k) for k in self.seen):
                break
            time.sleep(0.2)
        survivors = [k for k in self.seen if _alive(k)]
        if survivors:
            groups = {leader}
            for pid, start in survivors:
                st = _stat(pid)
                if st is not None and st[2] == start:
                    groups.add(st[1])
            groups.discard(os.getpgrp())
            for pgid in groups:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            for pid, start in survivors:
                if _alive((pid, start)):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)
        return sorted(pid for pid, start in self.seen if _alive((pid, start)))


@dataclass
class ServerRun:
    """What `run_on_server` saw: the work's result (None when anything failed), the seconds
    the server took to be healthy, the pids still alive after the stop, and the failure."""

    result: Any = None
    startup_s: float | None = None
    survivors: list[int] = field(default_factory=list)
    error: str | None = None


def run_on_server(
    server: Server,
    timeout_s: float,
    work: Callable[[str], Any],
    *,
    wait_healthy: Callable[[float], float] | None = None,
    say_healthy: bool = False,
    error_chars: int | None = None,
    alive_note: str = "processes still alive after SIGKILL",
) -> ServerRun:
    """Start `server`, wait until it is healthy (`wait_healthy`, default its own
    `wait_healthy`), run `work(base_url)`, then stop it whatever happened and report the
    processes left. A failure is printed and returned, not raised, so the other arms still
    run. `say_healthy` prints the startup time; `error_chars` cuts the printed failure."""
    run = ServerRun()
    try:
        server.start()
        run.startup_s = (wait_healthy or server.wait_healthy)(timeout_s)
        if say_healthy:
            print(f"  {server.name}: healthy after {run.startup_s:.1f}s", flush=True)
        run.result = work(server.base_url)
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {exc or '(no message)'}"
        print(f"  {server.name}: FAILED: {run.error[:error_chars]}", flush=True)
    finally:
        run.survivors = server.stop()
        if run.survivors:
            print(f"  {server.name}: {alive_note}: {run.survivors}", flush=True)
        else:
            print(f"  {server.name}: stopped; no process left", flush=True)
    return run
