"""Start a chain of real `pagoda worker` processes on loopback ports for tests."""

from __future__ import annotations

from pathlib import Path

from wiring.launcher import ServiceProcess, worker_chain


def start_chain(
    model_dir: str,
    num_stages: int,
    log_dir: Path,
    num_kv_blocks: int = 256,
    block_size: int = 16,
    extra: tuple[str, ...] = (),
) -> list[ServiceProcess]:
    procs = worker_chain(
        model_dir, num_stages, num_kv_blocks, block_size, threads=1, extra_args=lambda k: extra, log_dir=log_dir
    )
    for p in reversed(procs):
        p.start()
    try:
        for p in procs:
            p.wait_healthy(90)
    except Exception:
        for p in procs:
            p.kill()
        raise
    return procs
