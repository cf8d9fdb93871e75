"""Start a chain of real `pagoda worker` processes on loopback ports for tests."""

from __future__ import annotations

from pathlib import Path

from services.launcher import ServiceProcess, free_port, pagoda_command


def start_chain(
    model_dir: str,
    num_stages: int,
    log_dir: Path,
    num_kv_blocks: int = 256,
    block_size: int = 16,
    extra: tuple[str, ...] = (),
) -> list[ServiceProcess]:
    ports = [free_port() for _ in range(num_stages)]
    procs = []
    for k in reversed(range(num_stages)):
        args = [
            "worker", "--model", model_dir, "--stage", str(k), "--num-stages", str(num_stages),
            "--port", str(ports[k]), "--num-kv-blocks", str(num_kv_blocks),
            "--block-size", str(block_size), "--num-threads", "1", *extra,
        ]
        if k < num_stages - 1:
            args += ["--next", f"127.0.0.1:{ports[k + 1]}"]
        proc = ServiceProcess(
            f"worker-{k}", pagoda_command(*args), f"127.0.0.1:{ports[k]}",
            log_path=log_dir / f"worker-{k}.log",
        )
        proc.start()
        procs.append(proc)
    procs.reverse()
    try:
        for p in procs:
            p.wait_healthy(90)
    except Exception:
        for p in procs:
            p.kill()
        raise
    return procs
