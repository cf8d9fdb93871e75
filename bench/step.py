"""Benchmark: the cost of one step, in-process and over the gRPC stack (no gateway).

    .venv/bin/python -m bench.step --arms local-sync,local-async,grpc-sync,grpc-async \
        --pp 1,2 --out /tmp/bench_step.json

The anchor checkpoint of ../shared/anchors/vllm-cpu.md (7.4M-parameter Llama, float32) is
made once under `--model-dir`. Two loads, greedy with `ignore_eos`:

- throughput: `--concurrency` (64) requests in flight at once, each 128 random prompt
  tokens -> 64 generated; output tokens per second over the whole run;
- latency: one request alone, 128 -> 64, `--repeats` times after a warm-up; the median end
  to end, and time per output token after the first.

Arms: `local-*` drive `build_local_engine` (one process, stages run in turn on one thread);
`grpc-*` start the stack as real processes (`wiring.launcher.start_stack`: KV service,
workers with one torch thread each, scheduler) and call `Scheduler.Generate`. `*-sync` and
`*-async` set `async_scheduling`. For gRPC arms the bytes each stage received per decode
step per sequence are read back from the stages' statistics (`num_received_bytes`): the
difference between two runs of the same cached prompts decoding 16 and 48 tokens.

Not a test: numbers depend on the machine. Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT_LEN, OUTPUT_LEN = 128, 64


def make_model(model_dir: Path) -> Path:
    if (model_dir / "config.json").exists():
        return model_dir
    from wiring import tiny_model

    spec = tiny_model.TinyModelSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, vocab_size=8192)
    tiny_model.make_tiny_model(model_dir, spec, overwrite=True)
    return model_dir


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(PROMPT_LEN)] for _ in range(n)]


# --- in-process ------------------------------------------------------------------------


async def local_arm(model_dir: Path, pp: int, is_async: bool, concurrency: int, repeats: int) -> dict:
    import torch

    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.request import Request, SamplingOptions
    from wiring.local_engine import build_local_engine

    torch.set_num_threads(1)
    config = SchedulerConfig(
        model=str(model_dir), pipeline_parallel_size=pp, async_scheduling=is_async, num_kv_blocks=2048
    )
    engine = build_local_engine(str(model_dir), config, num_kv_blocks=2048)
    await engine.start()
    options = SamplingOptions(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    counter = iter(range(10**9))

    async def one(prompt: list[int]) -> int:
        stream = engine.submit(Request(f"r{next(counter)}", tuple(prompt), options, arrival_s=0.0))
        n = 0
        async for out in stream:
            n += sum(len(d.token_ids) for d in out.deltas)
        return n

    try:
        return await _loads(one, concurrency, repeats)
    finally:
        await engine.stop()


# --- over gRPC -------------------------------------------------------------------------


async def grpc_arm(model_dir: Path, pp: int, is_async: bool, concurrency: int, repeats: int) -> dict:
    from services.grpc_utils import aio_channel
    from services.pb import scheduler_pb2, scheduler_pb2_grpc
    from wiring.launcher import start_stack

    flag = "--async-scheduling" if is_async else "--no-async-scheduling"
    with tempfile.TemporaryDirectory() as logs:
        stack = start_stack(
            str(model_dir),
            num_stages=pp,
            num_kv_blocks=2048,
            log_dir=Path(logs),
            scheduler_args=[flag],
            threads_per_worker=1,
        )
        try:
            channel = aio_channel(stack.scheduler_address, 64 << 20)
            stub = scheduler_pb2_grpc.SchedulerStub(channel)

            async def one(prompt: list[int], max_tokens: int = OUTPUT_LEN) -> int:
                req = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt)
                req.sampling_params.max_tokens = max_tokens
                req.sampling_params.temperature = 0.0
                req.sampling_params.ignore_eos = True
                n = 0
                async for resp in stub.Generate(req):
                    n += len(resp.token_ids)
                return n

            out = await _loads(one, concurrency, repeats)
            out["decode_bytes_per_seq_step"] = await _wire_bytes(stub, one, concurrency)
            await channel.close()
            return out
        finally:
            stack.stop()


async def _wire_bytes(stub, one, concurrency: int) -> list[float]:
    """Bytes each stage received per sequence per decode step: the difference between two
    runs of the same (cached) prompts that differ only in how many tokens they decode."""
    from services.pb import scheduler_pb2

    async def received() -> list[int]:
        stats = await stub.GetStats(scheduler_pb2.GetStatsRequest())
        return [s.stats.num_received_bytes for s in stats.stages]

    batch = prompts(concurrency, seed=99)
    await asyncio.gather(*(one(p, 1) for p in batch))  # prefill once: later runs hit the cache
    sizes = []
    for steps in (16, 48):
        before = await received()
        await asyncio.gather(*(one(p, steps) for p in batch))
        sizes.append([a - b for a, b in zip(await received(), before, strict=True)])
    return [round((b - a) / (concurrency * 32), 1) for a, b in zip(*sizes, strict=True)]


# --- loads -----------------------------------------------------------------------------


async def _loads(one, concurrency: int, repeats: int) -> dict:
    await asyncio.gather(*(one(p) for p in prompts(8, seed=1)))  # warm-up
    best = 0.0
    for r in range(max(1, repeats // 2)):
        batch = prompts(concurrency, seed=10 + r)
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in batch))
        wall = time.perf_counter() - start
        assert all(c == OUTPUT_LEN for c in counts), counts
        best = max(best, sum(counts) / wall)
    latencies = []
    for r in range(repeats):
        (p,) = prompts(1, seed=1000 + r)
        start = time.perf_counter()
        n = await one(p)
        latencies.append(time.perf_counter() - start)
        assert n == OUTPUT_LEN
    median = statistics.median(latencies)
    return {
        "throughput_tok_s": round(best, 1),
        "latency_s": round(median, 4),
        "ms_per_output_token": round(1000 * median / OUTPUT_LEN, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "pagoda-anchor-7m")
    ap.add_argument("--arms", default="local-sync,local-async,grpc-sync,grpc-async")
    ap.add_argument("--pp", default="1,2")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_dir = make_model(args.model_dir)
    rows = []
    for pp in [int(x) for x in args.pp.split(",")]:
        for arm in args.arms.split(","):
            where, mode = arm.split("-")
            run = local_arm if where == "local" else grpc_arm
            result = asyncio.run(run(model_dir, pp, mode == "async", args.concurrency, args.repeats))
            row = {"arm": arm, "pp": pp, **result}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| arm | PP | output tok/s (64 in flight) | latency 128->64 (s) | ms/token | stage bytes/seq/decode step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        wire = r.get("decode_bytes_per_seq_step", "-")
        print(
            f"| {r['arm']} | {r['pp']} | {r['throughput_tok_s']:,.0f} | {r['latency_s']:.3f} | "
            f"{r['ms_per_output_token']:.2f} | {wire} |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
