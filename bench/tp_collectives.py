"""The all-reduce of two tensor-parallel ranks on one host: gloo over loopback against the
ranks' shared memory (worker_svc/execution/shm_collectives.py), in the same run.

    .venv/bin/python -m bench.tp_collectives [--iters 2000] [--hidden 4096]

Starts two processes (one thread each), which reduce [rows, hidden] float32 tensors for rows
in 1 and 64 (one decode token, a batch of 64) `--iters` times each way, and prints the
microseconds per all-reduce and the ratio gloo / shared memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rank_main(rank: int, port: int, path: str, iters: int, hidden: int) -> None:
    import torch
    import torch.distributed as dist

    from worker_svc.execution.shm_collectives import ShmCollectives

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    shm = ShmCollectives(0, 2, path, create=True) if rank == 0 else None
    dist.barrier()  # created
    shm = shm or ShmCollectives(rank, 2, path, create=False)
    dist.barrier()  # mapped by both
    if rank == 0:
        shm.unlink()
    out = {}
    for rows in (1, 64):
        x = torch.ones(rows, hidden)
        for name, fn in (("gloo", lambda x=x: dist.all_reduce(x)), ("shm", lambda x=x: shm.all_reduce(x))):
            for _ in range(min(100, iters)):
                fn()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            out[f"{name}_{rows}"] = 1e6 * (time.perf_counter() - start) / iters
    if rank == 0:
        print(json.dumps(out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.path, args.iters, args.hidden)
        return 0
    import socket

    from worker_svc.execution.shm_collectives import ShmCollectives

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = ShmCollectives.new_path()
    common = ["--port", str(port), "--path", path, "--iters", str(args.iters), "--hidden", str(args.hidden)]
    peer = subprocess.Popen([sys.executable, __file__, "--rank", "1", *common])
    lead = subprocess.run([sys.executable, __file__, "--rank", "0", *common], capture_output=True, text=True)
    peer.wait()
    figures = json.loads(lead.stdout.strip().splitlines()[-1])
    print(f"all-reduce of 2 ranks on one host, float32 [rows, {args.hidden}], {args.iters} each, us per call")
    print("rows   gloo     shared memory   gloo / shm")
    for rows in (1, 64):
        g, m = figures[f"gloo_{rows}"], figures[f"shm_{rows}"]
        print(f"{rows:>4}  {g:7.0f}   {m:13.0f}   {g / m:9.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
