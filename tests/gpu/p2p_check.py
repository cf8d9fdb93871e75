"""The data plane's GPU channels (issue 37, worker_svc/execution/data_plane.py) on a lent device:
two stages' sides in one process, their offer answered in place (no gRPC), hidden states of
[rows, 4096] bfloat16 and float32 handed on and checked bit for bit, each hop timed.

- With two GPUs or more: the NCCL link (cuda:0 -> cuda:1), as `--stage-channel nccl`.
- With one GPU: the receiver on the sender's GPU refuses NCCL (it needs a GPU per rank), so
  `auto` falls back to the shared-memory ring, GPU tensors copied through it; that fallback
  is checked and timed.
- Always: the link's protocol on gloo (CPU), as the tests run it.

    python tests/gpu/p2p_check.py               # on the GPU machine (seconds)
    python tests/gpu/p2p_check.py --cpu-smoke   # here: the gloo and ring cases only

Figures go to `$OUT/gpu_p2p.json` (or ./gpu_p2p.json); the exit status is non-zero when a
hand-off changes a bit, a channel is not the one expected, or there is no CUDA device outside
--cpu-smoke.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from worker_svc.execution.data_plane import DataPlaneIn, DataPlaneOut, received  # noqa: E402
from worker_svc.execution.stage_ring import slot_bytes_for  # noqa: E402

HIDDEN = 4096


class LoopbackStub:
    def __init__(self, inbound: DataPlaneIn) -> None:
        self.inbound = inbound

    async def OpenDataPlane(self, offer, timeout=None):
        return await self.inbound.accept(offer)


async def _hops(out: DataPlaneOut, inbound: DataPlaneIn, rows: int, dtype: torch.dtype, iters: int) -> dict:
    from services.pb import worker_pb2

    x = torch.randn(rows, HIDDEN, device=out.device).to(dtype)
    loop = asyncio.get_running_loop()
    times = []
    for i in range(iters + 5):
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        start = time.perf_counter()
        mb = worker_pb2.MicroBatch(micro_batch_id=i)
        await out.place(out.pack(x, mb), mb)
        got, release = inbound.hidden(mb)
        got = await loop.run_in_executor(None, received, got)
        got = got.to(inbound.device)
        if inbound.device.type == "cuda":
            torch.cuda.synchronize(inbound.device)
        times.append(time.perf_counter() - start)
        if not torch.equal(got.to(x.device), x):
            raise AssertionError(f"hand-off {i} of {rows} rows changed bits")
        if release is not None:
            release()
    times = times[5:]
    return {
        "rows": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "p50_us": 1e6 * statistics.median(times),
        "p99_us": 1e6 * sorted(times)[int(0.99 * (len(times) - 1))],
    }


async def _case(name: str, sender: str, receiver: str, send_dev: str, recv_dev: str, expect: str, iters: int) -> dict:
    out = DataPlaneOut(sender, 0, slot_bytes_for(2048, HIDDEN), device=send_dev)
    inbound = DataPlaneIn(receiver, recv_dev)
    await out.connect(LoopbackStub(inbound), timeout_s=60)
    if out.channel != expect:
        raise AssertionError(f"{name}: channel {out.channel!r}, expected {expect!r}")
    hops = [
        await _hops(out, inbound, rows, dtype, iters)
        for rows in (1, 16, 64)
        for dtype in (torch.float32, torch.bfloat16)
    ]
    channel = out.channel
    out.drop()
    return {"case": name, "channel": channel, "sender": send_dev, "receiver": recv_dev, "hops": hops}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", type=Path, default=None, help="default: $OUT/gpu_p2p.json or ./gpu_p2p.json")
    args = p.parse_args()
    out_path = args.out or Path(os.environ.get("OUT") or ".") / "gpu_p2p.json"
    cases = [
        ("gloo link (the protocol's CPU run)", "nccl", "auto", "cpu", "cpu", "gloo"),
        ("shm ring, CPU stages", "auto", "auto", "cpu", "cpu", "shm"),
    ]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        cases.append(("NCCL link cuda:0 -> cuda:1", "nccl", "auto", "cuda:0", "cuda:1", "nccl"))
    elif gpus == 1:
        cases.append(
            ("one GPU: auto refuses NCCL, GPU tensors through the ring", "auto", "auto", "cuda:0", "cuda:0", "shm")
        )
    report: dict = {"gpus": gpus, "cases": [], "failures": []}
    for case in cases:
        try:
            result = asyncio.run(_case(*case, iters=args.iters if gpus or not args.cpu_smoke else 20))
            report["cases"].append(result)
            print(json.dumps(result), flush=True)
        except Exception:  # noqa: BLE001 - every case reported
            report["failures"].append({"case": case[0], "error": traceback.format_exc()})
            print(f"FAILED {case[0]}\n{traceback.format_exc()}", flush=True)
        out_path.write_text(json.dumps(report, indent=2) + "\n")
    if not gpus and not args.cpu_smoke:
        print("no CUDA device", flush=True)
        return 1
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
