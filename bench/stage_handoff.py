"""One hop of the data plane (issue 37): a stage's hidden states handed to the next stage
through the pair's shared-memory ring against inside the gRPC message, in the same run; and
the ring with the message on the next stage's local socket instead of gRPC ("unix":
services/local_stream.py, what stages on one host take).

    .venv/bin/python -m bench.stage_handoff [--iters 300] [--hidden 4096 576] [--rows 1 16 64]

Starts a receiver process (a gRPC StageWorker server that takes the ring's offer and reads
micro-batches, worker_svc/execution/data_plane.py's DataPlaneIn, as a stage does), and sends
it `--iters` micro-batches of [rows, hidden] float32 hidden states on each channel, one at a
time (a pause between them, so that none queues behind another), with the stage's own code
(DataPlaneOut.pack / place, the Forward stream). A hand-off is timed from the sender holding
the step's output (before it is written to the ring or encoded) to the receiver holding a
tensor it can compute on (the ring's slot in place, or the message's bytes decoded), on one
monotonic clock (one host). Prints p50 and p99 per channel and shape, and the ratio gRPC /
shared memory; `--json` writes them too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MAX_TOKENS = 2048  # a stage's default max_num_batched_tokens: the ring's slots hold that many rows


def _percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _receive(port_file: str, out_file: str) -> None:
    """The receiving stage: takes the ring, decodes each micro-batch's hidden states, notes
    when it held them, releases the slot."""
    import grpc
    import torch

    from services.local_stream import LocalListener
    from services.pb import worker_pb2, worker_pb2_grpc
    from worker_svc.execution.data_plane import DataPlaneIn

    torch.set_num_threads(1)
    inbound = DataPlaneIn("auto")
    latencies: list[tuple[str, int]] = []

    class Receiver(worker_pb2_grpc.StageWorkerServicer):
        async def OpenDataPlane(self, request, context):
            return await inbound.accept(request)

        async def Forward(self, request_iterator, context, via: str = ""):
            n = 0
            async for mb in request_iterator:
                t, release = inbound.hidden(mb)
                held = time.monotonic_ns()
                latencies.append((f"{via or inbound.channel} {t.shape[0]}x{t.shape[1]}", held - mb.sent_ns))
                if release is not None:
                    release()
                n += 1
            Path(out_file).write_text(json.dumps(latencies))
            latencies.clear()
            return worker_pb2.ForwardSummary(num_micro_batches=n)

    options = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
    server = grpc.aio.server(options=options)
    receiver = Receiver()
    worker_pb2_grpc.add_StageWorkerServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def local_forward(stream) -> None:
        await receiver.Forward(stream.messages(worker_pb2.MicroBatch), stream.context, via="unix")

    listener = LocalListener({"Forward": local_forward}, 256 << 20)
    await listener.start()
    Path(port_file).write_text(json.dumps([port, listener.address, listener.token.hex()]))
    await server.wait_for_termination()


async def _send(
    port: tuple, channel: str, hidden: int, rows_list: list[int], iters: int, out_file: str, pause_s: float
) -> dict[str, list[float]]:
    import grpc
    import torch

    from services.local_stream import open_call
    from services.pb import worker_pb2, worker_pb2_grpc
    from worker_svc.execution.data_plane import DataPlaneOut
    from worker_svc.execution.stage_ring import slot_bytes_for

    options = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
    grpc_port, local_address, local_token = port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) as ch:
        stub = worker_pb2_grpc.StageWorkerStub(ch)
        out = DataPlaneOut("shm" if channel == "unix" else channel, 0, slot_bytes_for(MAX_TOKENS, hidden))
        await out.connect(stub)
        if channel == "unix":
            call = await open_call(local_address, bytes.fromhex(local_token), "Forward", max_message_bytes=256 << 20)
        else:
            call = stub.Forward()
        for rows in rows_list:
            x = torch.randn(rows, hidden)
            for i in range(iters + 20):  # the first 20: warm-up, dropped below
                mb = worker_pb2.MicroBatch(micro_batch_id=i, stage_index=1)
                mb.sent_ns = time.monotonic_ns()  # the step's output is ready
                kept = out.pack(x, mb)
                await out.place(kept, mb)
                await call.write(mb)
                await asyncio.sleep(pause_s)
        await call.done_writing()
        await call
    got: dict[str, list[float]] = {}
    for key, ns in json.loads(Path(out_file).read_text()):
        got.setdefault(key, []).append(ns / 1e3)
    return {k: v[20:] for k, v in got.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 576])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--pause-ms", type=float, default=3.0)
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(_receive(*args.serve))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        port_file, out_file = f"{tmp}/port", f"{tmp}/latencies.json"
        receiver = subprocess.Popen(
            [sys.executable, "-m", "bench.stage_handoff", "--serve", port_file, out_file],
            cwd=Path(__file__).resolve().parent.parent,
        )
        try:
            deadline = time.monotonic() + 60
            while not Path(port_file).exists() or not Path(port_file).read_text():
                if time.monotonic() > deadline or receiver.poll() is not None:
                    raise SystemExit("the receiver did not start")
                time.sleep(0.05)
            port = tuple(json.loads(Path(port_file).read_text()))
            results: dict[str, list[float]] = {}
            for hidden in args.hidden:
                for channel in ("shm", "grpc", "unix"):
                    results.update(
                        asyncio.run(_send(port, channel, hidden, args.rows, args.iters, out_file, args.pause_ms / 1e3))
                    )
        finally:
            receiver.terminate()
            receiver.wait(10)
    return _report(results, args)


def _report(results: dict[str, list[float]], args) -> int:
    print(f"stage hand-off latency, one hop, microseconds ({args.iters} hand-offs each, float32 hidden states)")
    print(
        f"{'shape':>10} {'shm p50':>9} {'shm p99':>9} {'grpc p50':>9} {'grpc p99':>9} {'p50 ratio':>9}"
        f" {'unix p50':>9} {'unix p99':>9} {'shm/unix':>9}"
    )
    table = []
    for hidden in args.hidden:
        for rows in args.rows:
            shape = f"{rows}x{hidden}"
            shm, grpc_ = results.get(f"shm {shape}"), results.get(f"grpc {shape}")
            if not shm or not grpc_:
                print(f"{shape:>10}  missing: shm {bool(shm)}, grpc {bool(grpc_)}")
                continue
            row = {
                "shape": shape,
                "shm_p50_us": _percentile(shm, 0.5),
                "shm_p99_us": _percentile(shm, 0.99),
                "grpc_p50_us": _percentile(grpc_, 0.5),
                "grpc_p99_us": _percentile(grpc_, 0.99),
            }
            row["ratio_p50"] = row["grpc_p50_us"] / row["shm_p50_us"]
            unix = results.get(f"unix {shape}") or [float("nan")]
            row["unix_p50_us"], row["unix_p99_us"] = _percentile(unix, 0.5), _percentile(unix, 0.99)
            row["shm_over_unix_p50"] = row["shm_p50_us"] / row["unix_p50_us"]
            table.append(row)
            print(
                f"{shape:>10} {row['shm_p50_us']:9.1f} {row['shm_p99_us']:9.1f} {row['grpc_p50_us']:9.1f} "
                f"{row['grpc_p99_us']:9.1f} {row['ratio_p50']:8.2f}x {row['unix_p50_us']:9.1f} "
                f"{row['unix_p99_us']:9.1f} {row['shm_over_unix_p50']:8.2f}x"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
