"""Micro-benchmark: shipping activations between two pipeline stages, against their compute.

    .venv/bin/python -m bench.activations --models tiny,25m --sizes 1,16,256 --reps 20 \
        --out /tmp/bench_activations.json

For each model it starts a chain of two real `pagoda worker` processes on loopback (one torch
thread each), holds an `Events` stream from both and a `Forward` stream into stage 0, and sends
micro-batches of N tokens in two shapes:

- prefill: one sequence prefilling N tokens (positions 0 ... N-1);
- decode:  N sequences of one decode token each, at context length `--decode-context`.

Micro-batches go one at a time (the next is sent once the last stage has reported the previous
one), so that no queueing inside a stage blurs the times; each shape and size is sent
`--warmup` times unmeasured, then `--reps` times. Sequence ids are new for every micro-batch;
the previous micro-batch's sequences are released, and their blocks reused, as a scheduler
would after freeing them.

From the `StepTiming` each stage reports (wall-clock ns, one clock: same machine):

- compute          = compute_end - compute_start, per stage
- ship             = stage-1 received - stage-0 compute_end  (activations from stage 0 to 1)
    encode         = stage-1 sent - stage-0 compute_end      (compute thread -> sender hand-off,
                                                              hidden states -> bytes on stage 0;
                                                              stage 0 stamps MicroBatch.sent_ns
                                                              just before the write)
    wire           = stage-1 received - stage-1 sent         (serialize, write, loopback,
                                                              HTTP/2, protobuf parse)
- s1 decode+queue  = stage-1 compute_start - stage-1 received (plan and tensor decode, queue)

(Stages report a micro-batch as its compute ends, before the hand-off, so
`StepTiming.forwarded_ns` is 0: the next stage's `sent_ns` carries the hand-off time.)

Bytes per micro-batch are the MicroBatch bytes stage 0 sent downstream (its GetStats counter).
This is a benchmark, not a test: it asserts nothing about the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from bench.machine import cpu_model
from services import defaults
from services.grpc_utils import aio_channel
from services.pb import common_pb2, worker_pb2, worker_pb2_grpc
from services.sampling import SamplingParams
from services.step import NewSeq, StepPlan
from services.step_codec import plan_to_pb
from wiring.launcher import ServiceProcess, free_port, pagoda_command, stop_all
from wiring.tiny_model import PRESETS, default_model_dir

SHAPES = ("prefill", "decode")
GREEDY = SamplingParams(temperature=0.0)
NUM_STAGES = 2
MS = 1e-6  # ns -> ms


# --- the chain -------------------------------------------------------------------------


def start_workers(
    model_dir: Path, log_dir: Path, num_kv_blocks: int, block_size: int, max_num_seqs: int
) -> list[ServiceProcess]:
    """Two `pagoda worker` processes on loopback, stage 1 started first; waits until healthy."""
    ports = [free_port() for _ in range(NUM_STAGES)]
    procs: list[ServiceProcess] = []
    for k in reversed(range(NUM_STAGES)):
        args = [
            "worker",
            "--model",
            str(model_dir),
            "--stage",
            str(k),
            "--num-stages",
            str(NUM_STAGES),
            "--port",
            str(ports[k]),
            "--num-kv-blocks",
            str(num_kv_blocks),
            "--block-size",
            str(block_size),
            "--max-num-seqs",
            str(max_num_seqs),
            "--num-threads",
            "1",
        ]
        if k < NUM_STAGES - 1:
            args += ["--next", f"127.0.0.1:{ports[k + 1]}"]
        proc = ServiceProcess(
            f"worker-{k}", pagoda_command(*args), f"127.0.0.1:{ports[k]}", log_path=log_dir / f"worker-{k}.log"
        )
        proc.start()
        procs.insert(0, proc)
    try:
        for p in procs:
            p.wait_healthy(120)
    except BaseException:
        stop_all(procs)
        raise
    return procs


@dataclass
class Sample:
    """One measured micro-batch: the driver's send time and each stage's timing."""

    micro_batch_id: int
    driver_sent_ns: int
    timings: list[worker_pb2.StepTiming] = field(default_factory=list)


class Driver:
    """Sends micro-batches into stage 0 one at a time and waits for every stage's `done`."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.channels = [aio_channel(a) for a in addresses]
        self.stubs = [worker_pb2_grpc.StageWorkerStub(c) for c in self.channels]
        self.load_info: list[worker_pb2.StageLoadInfo | None] = [None] * len(addresses)
        self._done: dict[tuple[int, int], worker_pb2.MicroBatchDone] = {}
        self._arrived = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._forward = None
        self._next_mb = 0

    async def connect(self) -> None:
        for i, stub in enumerate(self.stubs):
            ready = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._read_events(i, stub, ready)))
            await asyncio.wait_for(ready.wait(), timeout=30)
        self._forward = self.stubs[0].Forward()
        self._tasks.append(asyncio.create_task(self._watch_forward()))

    async def close(self) -> None:
        if self._forward is not None:
            self._forward.cancel()
        for task in self._tasks:
            task.cancel()
        for channel in self.channels:
            await channel.close()

    async def _read_events(self, index: int, stub, ready: asyncio.Event) -> None:
        request = worker_pb2.EventsRequest(subscriber="bench_activations")
        async for event in stub.Events(request):
            if event.HasField("ready"):
                self.load_info[index] = event.ready
                ready.set()
                continue
            async with self._arrived:
                self._done[(index, event.done.micro_batch_id)] = event.done
                self._arrived.notify_all()

    async def _watch_forward(self) -> None:  # (it answers only when the stream ends)
        try:
            await self._forward
        except grpc.aio.AioRpcError:
            pass

    def new_micro_batch_id(self) -> int:
        self._next_mb += 1
        return self._next_mb

    async def run_one(self, plan: StepPlan, timeout_s: float = 120.0) -> Sample:
        mb = plan_to_pb(plan)
        sample = Sample(plan.step_id, time.time_ns())
        mb.sent_ns = sample.driver_sent_ns
        await self._forward.write(mb)
        keys = [(i, plan.step_id) for i in range(len(self.stubs))]

        def arrived() -> bool:  # the last stage reports every stage's timing; any stage a failure
            return keys[-1] in self._done or any(k in self._done and self._done[k].HasField("error") for k in keys)

        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(arrived), timeout_s)
        for i, k in enumerate(keys):
            done = self._done.pop(k, None)
            if done is not None and done.HasField("error"):
                raise RuntimeError(
                    f"stage {i} failed micro-batch {plan.step_id}: {_code_name(done.error.code)} {done.error.message}"
                )
        sample.timings.extend([*done.upstream_timings, done.timing])
        return sample

    async def sent_bytes(self) -> int:
        return (await self.stubs[0].GetStats(worker_pb2.StageStatsRequest())).num_sent_bytes


def _code_name(code: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))


# --- the micro-batches ------------------------------------------------------------------


class PlanMaker:
    """Micro-batches of both shapes; blocks [0, n) are reused by every micro-batch."""

    def __init__(self, block_size: int, vocab_size: int, decode_context: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.decode_context = decode_context
        self._next_seq = 0
        self._previous: tuple[int, ...] = ()
        self._gen = torch.Generator().manual_seed(0)

    @staticmethod
    def blocks_needed(max_tokens: int, block_size: int, decode_context: int) -> int:
        per_decode_seq = -(-decode_context // block_size)
        return max(-(-max_tokens // block_size), max_tokens * per_decode_seq)

    def _tokens(self, n: int) -> tuple[int, ...]:
        # ids >= 5 skip the special tokens
        return tuple(torch.randint(5, self.vocab_size, (n,), generator=self._gen).tolist())

    def _seq(self, num_tokens: int, context_len: int, first_block: int) -> NewSeq:
        """A fresh sequence computing its last `num_tokens` of `context_len` (sent whole: a
        decode shape at a given context with new ids each time, as the original benchmark)."""
        self._next_seq += 1
        bs = self.block_size
        table = tuple(range(first_block, first_block + -(-context_len // bs)))
        return NewSeq(
            self._next_seq,
            self._tokens(context_len),
            context_len,
            context_len - num_tokens,
            num_tokens,
            table,
            GREEDY,
            0,
            self._next_seq,
        )

    def make(self, micro_batch_id: int, shape: str, num_tokens: int) -> StepPlan:
        if shape == "prefill":
            seqs = (self._seq(num_tokens, num_tokens, 0),)
        else:
            per_seq = -(-self.decode_context // self.block_size)
            seqs = tuple(self._seq(1, self.decode_context, i * per_seq) for i in range(num_tokens))
        plan = StepPlan(micro_batch_id, seqs, finished_seq_ids=self._previous)
        self._previous = tuple(s.seq_id for s in seqs)
        return plan


# --- statistics -------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    # nearest-rank p90: a value that was measured
    p90 = ordered[max(0, -(-9 * len(ordered) // 10) - 1)]
    return {"median": statistics.median(ordered), "p90": p90, "min": ordered[0], "max": ordered[-1]}


def metrics(sample: Sample) -> dict[str, int]:
    s0, s1 = sample.timings
    return {
        "compute_s0_ns": s0.compute_end_ns - s0.compute_start_ns,
        "compute_s1_ns": s1.compute_end_ns - s1.compute_start_ns,
        "ship_ns": s1.received_ns - s0.compute_end_ns,
        "encode_s0_ns": s1.sent_ns - s0.compute_end_ns,
        "wire_ns": s1.received_ns - s1.sent_ns,
        "decode_queue_s1_ns": s1.compute_start_ns - s1.received_ns,
        "ship_to_compute_ns": s1.compute_start_ns - s0.compute_end_ns,
        "driver_to_s0_ns": s0.received_ns - sample.driver_sent_ns,
    }


def timing_problems(sample: Sample) -> list[str]:
    """Fields a stage left unset, or set to something other than what the proto says."""
    problems = []
    for i, t in enumerate(sample.timings):
        for name in ("received_ns", "compute_start_ns", "compute_end_ns"):
            if getattr(t, name) == 0:
                problems.append(f"stage {i}: {name} unset")
        if i > 0 and t.sent_ns == 0:
            problems.append(f"stage {i}: sent_ns unset")
    if sample.timings[0].sent_ns != sample.driver_sent_ns:
        problems.append(
            "stage 0: timing.sent_ns is not the upstream MicroBatch.sent_ns "
            "(it reports the sent_ns it stamped on the message it forwarded)"
            if sample.timings[0].sent_ns == sample.timings[1].sent_ns
            else "stage 0: timing.sent_ns is not the upstream MicroBatch.sent_ns"
        )
    last = sample.timings[-1]
    if last.forwarded_ns and last.forwarded_ns < last.compute_end_ns:
        problems.append("last stage: forwarded_ns before compute_end_ns")
    return problems


# --- one model --------------------------------------------------------------------------


async def bench_model(name: str, model_dir: Path, args: argparse.Namespace) -> dict:
    max_tokens = max(args.sizes)
    num_kv_blocks = PlanMaker.blocks_needed(max_tokens, args.block_size, args.decode_context) + 1
    with tempfile.TemporaryDirectory(prefix="bench-activations-") as log_dir:
        procs = start_workers(model_dir, Path(log_dir), num_kv_blocks, args.block_size, max(256, max_tokens))
        driver = Driver([p.health_address for p in procs])
        try:
            await driver.connect()
            info = driver.load_info
            maker = PlanMaker(args.block_size, info[0].vocab_size, args.decode_context)
            dtype_name = common_pb2.DType.Name(info[0].dtype).removeprefix("DTYPE_").lower()
            itemsize = getattr(torch, dtype_name).itemsize
            runs, problems = [], {}
            for shape in args.shapes:
                for n in args.sizes:
                    for _ in range(args.warmup):
                        await driver.run_one(maker.make(driver.new_micro_batch_id(), shape, n))
                    bytes_before = await driver.sent_bytes()
                    samples = []
                    for _ in range(args.reps):
                        plan = maker.make(driver.new_micro_batch_id(), shape, n)
                        samples.append(await driver.run_one(plan))
                    bytes_per_mb = (await driver.sent_bytes() - bytes_before) / args.reps
                    for s in samples:
                        for p in timing_problems(s):
                            problems[p] = problems.get(p, 0) + 1
                    per_rep = [metrics(s) for s in samples]
                    runs.append(
                        {
                            "shape": shape,
                            "num_tokens": n,
                            "num_seqs": 1 if shape == "prefill" else n,
                            "bytes_per_micro_batch": bytes_per_mb,
                            "activation_bytes": n * info[0].hidden_size * itemsize,
                            "summary_ns": {k: summary([r[k] for r in per_rep]) for k in per_rep[0]},
                            "reps_ns": per_rep,
                        }
                    )
                    print(f"  {name} {shape:7s} {n:4d} tokens: done", file=sys.stderr, flush=True)
        except BaseException:
            for p in procs:
                print(p._log_tail(), file=sys.stderr)
            raise
        finally:
            await driver.close()
            stop_all(procs)
    spec = PRESETS[name]
    return {
        "model": name,
        "model_dir": str(model_dir),
        "num_parameters": spec.num_parameters,
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "stages": [
            {
                "stage": i,
                "layers": [li.layer_start, li.layer_end],
                "num_threads": li.num_threads,
                "device": li.device,
                "num_kv_blocks": li.num_kv_blocks,
            }
            for i, li in enumerate(info)
        ],
        "timing_problems": problems,
        "runs": runs,
    }


# --- output -----------------------------------------------------------------------------


def machine() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model(),
        "loadavg_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpc": grpc.__version__,
        "platform": platform.platform(),
    }


def fmt(ns: float) -> str:
    return f"{ns * MS:.3f}"


def markdown(report: dict) -> str:
    m = report["machine"]
    threads = sorted({s["num_threads"] for r in report["models"] for s in r["stages"]})
    lines = [
        f"Machine: {m['cpus_usable']} usable cores ({m['cpu_model'] or 'unknown CPU'}), "
        f"torch {m['torch']} with {','.join(map(str, threads))} intra-op thread(s) per stage, "
        f"load average {m['loadavg_1m']:.2f} at start / {report['loadavg_1m_end']:.2f} at end; "
        f"{report['config']['reps']} reps after {report['config']['warmup']} warm-up, one "
        f"micro-batch in flight; decode context {report['config']['decode_context']} tokens.",
        "",
        "Times in ms, median / p90. ship = stage-1 received - stage-0 compute end.",
        "",
        "| model | shape | tokens | bytes/mb | s0 compute | s1 compute | ship | ship/s0 compute | ship/s1 compute |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["models"]:
        for run in r["runs"]:
            s = run["summary_ns"]
            c0, c1, ship = s["compute_s0_ns"], s["compute_s1_ns"], s["ship_ns"]
            lines.append(
                f"| {r['model']} | {run['shape']} | {run['num_tokens']} "
                f"| {run['bytes_per_micro_batch']:,.0f} "
                f"| {fmt(c0['median'])} / {fmt(c0['p90'])} | {fmt(c1['median'])} / {fmt(c1['p90'])} "
                f"| {fmt(ship['median'])} / {fmt(ship['p90'])} "
                f"| {ship['median'] / c0['median']:.2f} | {ship['median'] / c1['median']:.2f} |"
            )
    lines += [
        "",
        "Where the shipping time goes (ms, medians): encode = stage 0 hands hidden states from "
        "its compute thread to its sender and turns them into bytes; wire = serialize + write + loopback + protobuf parse (stage-0 sent_ns -> stage-1 "
        "received_ns); s1 decode+queue = stage-1 received -> compute start (plan and tensor "
        "decode); ship->s1 compute = stage-0 compute end -> stage-1 compute start.",
        "",
        "| model | shape | tokens | encode (s0) | wire | s1 decode+queue | ship->s1 compute | driver->s0 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["models"]:
        for run in r["runs"]:
            s = run["summary_ns"]
            cells = ("encode_s0_ns", "wire_ns", "decode_queue_s1_ns", "ship_to_compute_ns", "driver_to_s0_ns")
            lines.append(
                f"| {r['model']} | {run['shape']} | {run['num_tokens']} | "
                + " | ".join(fmt(s[c]["median"]) for c in cells)
                + " |"
            )
    for r in report["models"]:
        for problem, count in r["timing_problems"].items():
            lines.append(f"\nTiming problem ({r['model']}, {count} micro-batches): {problem}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,25m", help=f"comma-separated, of {sorted(PRESETS)}")
    p.add_argument("--sizes", default="1,16,256", help="tokens per micro-batch, comma-separated")
    p.add_argument("--shapes", default=",".join(SHAPES), help="prefill,decode or one of them")
    p.add_argument("--reps", type=int, default=20, help="measured micro-batches per shape and size")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured micro-batches first")
    p.add_argument(
        "--decode-context",
        type=int,
        default=32,
        help="context length of each decode sequence (tokens, new one included)",
    )
    p.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE)
    p.add_argument(
        "--cache-dir", default=None, help="where models are made once (default: $PAGODA_CACHE_DIR or ~/.cache/pagoda)"
    )
    p.add_argument("--out", type=Path, default=None, help="write the full report as JSON here")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.sizes = [int(n) for n in args.sizes.split(",") if n]
    args.shapes = [s for s in args.shapes.split(",") if s]
    for m in args.models:
        if m not in PRESETS:
            p.error(f"--models: {m!r} is not one of {sorted(PRESETS)}")
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"--shapes: {s!r} is not one of {list(SHAPES)}")
    if not args.sizes or min(args.sizes) < 1 or args.reps < 1 or args.warmup < 0:
        p.error("--sizes must be positive, --reps >= 1, --warmup >= 0")
    if args.decode_context < 1:
        p.error("--decode-context must be >= 1")
    return args


async def main_async(args: argparse.Namespace) -> dict:
    report = {
        "benchmark": "bench_activations",
        "machine": machine(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "models": [],
    }
    for name in args.models:
        print(f"making/loading model {name} ...", file=sys.stderr, flush=True)
        model_dir = default_model_dir(cache_dir=args.cache_dir, spec=PRESETS[name])
        report["models"].append(await bench_model(name, model_dir, args))
    report["loadavg_1m_end"] = os.getloadavg()[0]
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    report = asyncio.run(main_async(args))
    report["wall_s"] = time.monotonic() - started
    print(markdown(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
