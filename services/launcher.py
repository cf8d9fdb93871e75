"""Starting services as local processes: start, wait until healthy, restart, tear down.

Each service runs in its own process group, so stopping it stops whatever it started;
`stop_all` sends SIGTERM, waits a grace period, then SIGKILL, leaving no orphans.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.grpc_utils import check_health


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the service binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pagoda_command(*args: str) -> list[str]:
    """The `pagoda` CLI run by this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "services.cli", *args]


@dataclass
class ServiceProcess:
    """One service process: its command line, the gRPC address its health is checked at."""

    name: str
    command: Sequence[str]
    health_address: str
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    process: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> None:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            list(self.command),
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if self.log_path:
            log.close()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode}{self._log_tail()}")
            if check_health(self.health_address, timeout_s=0.5):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not healthy at {self.health_address} after {timeout_s}s{self._log_tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, as tests simulate it)."""
        if self.alive:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self, grace_s: float = 5.0) -> None:
        if not self.alive:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def restart(self, timeout_s: float = 60.0) -> None:
        self.stop()
        self.restarts += 1
        self.start()
        self.wait_healthy(timeout_s)

    def _log_tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace")[-2000:]
        return f"\n--- {self.log_path} (tail) ---\n{tail}"


def stop_all(processes: Sequence[ServiceProcess], grace_s: float = 5.0) -> None:
    """Stop in reverse start order."""
    for p in reversed(processes):
        p.stop(grace_s)
