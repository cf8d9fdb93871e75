"""Benchmark: asynchronous against synchronous scheduling on the same workload.

    .venv/bin/python -m bench.scheduler --out /tmp/bench_scheduler.json

Two arms, `async_scheduling` on and off, both with pipeline parallelism 2, run the same
fixed-seed workload: `--num-requests` requests (prompts of `--prompt-len` tokens, outputs of
`--output-len` tokens, drawn uniformly; `ignore_eos`, greedy), sent closed-loop at
`--concurrency` (each client sends its next request when its last one finished).

- **gRPC** (the default path): the whole stack as real processes on loopback
  (`wiring.launcher.start_stack`: KV service, 2 stage workers with one torch thread each,
  scheduler), one stack per arm, the sync one started with `--no-async-scheduling`. Both
  stacks are up for the whole run and the arms alternate (sync first on even repeats), so
  that drift in the machine's load falls on both. Each stack is warmed up first.
- **in-process** (`--local`, on by default; `--no-local` to skip): `build_local_engine`
  with `SchedulerConfig(async_scheduling=..., pipeline_parallel_size=2)`, no gRPC. Its
  stages run one after the other on one thread, so here async scheduling can only hide the
  planning and the KV manager's bookkeeping behind compute, not overlap stages.

Per run: wall time (first request sent to last response), requests/s, output tokens/s, and
each stage's busy fraction = the growth of the stage's `busy_ns` over the run divided by
the run's wall time (from the scheduler's GetStats `stages[i].stats`; in-process from the
local transport's counters). Also the scheduler's own end-of-run `busy_fraction`
(busy / (busy + idle) since the stage's first micro-batch, warm-up included), micro-batches,
preemptions, and the `async_scheduling` flag as GetStats reads it back. The script checks
that both arms produced the same number of output tokens and counts the requests whose
greedy tokens are identical in both arms (a different batch can flip a near-tie).

Each repeat uses its own prompts (seed + repeat), the same for both arms, so that the
prefix cache never serves a repeat from an earlier one.

Not a test: numbers depend on the machine. Prints Markdown tables and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.machine import cpu_model  # noqa: E402
from bench.stats import percentile  # noqa: E402
from services import defaults  # noqa: E402
from services.grpc_utils import aio_channel  # noqa: E402
from services.pb import common_pb2, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from wiring.launcher import Stack, start_stack  # noqa: E402
from wiring.tiny_model import PRESETS, default_model_dir  # noqa: E402

NUM_STAGES = 2
ARMS = ("sync", "async")


# --- workload ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    prompt: list[int]
    max_tokens: int


def workload(
    num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int
) -> list[Work]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        out.append(Work([rng.randrange(5, vocab_size) for _ in range(n)], rng.randint(*output_len)))
    return out


@dataclass
class RunResult:
    path: str  # "grpc" or "in-process"
    arm: str  # "sync" or "async"
    repeat: int
    async_scheduling: bool  # as the engine reports it
    wall_s: float
    num_requests: int
    num_output_tokens: int
    num_expected_output_tokens: int
    stage_busy_s: list[float]
    stage_busy_fraction: list[float]  # busy_ns growth / wall time
    end_busy_fraction: list[float] = field(default_factory=list)  # GetStats, cumulative
    num_micro_batches: int = 0
    num_preemptions: int = 0
    latency_p50_s: float = 0.0
    latency_p90_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU time used during the run, per process
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("outputs")
        d["requests_per_s"] = self.requests_per_s
        d["output_tokens_per_s"] = self.output_tokens_per_s
        return d


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of a process (all its threads); this process when `pid` is None."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stack_cpu(stack: Stack) -> dict[str, float]:
    out = {p.name: cpu_seconds(p.process.pid) for p in stack.processes}
    out["client"] = cpu_seconds()
    return out


async def closed_loop(work: list[Work], concurrency: int, send) -> tuple[list[list[int]], list[float]]:
    """`concurrency` clients; each sends the next request (in order) once its last finished."""
    outputs: list[list[int]] = [[] for _ in work]
    latencies: list[float] = [0.0] * len(work)
    next_index = iter(range(len(work)))

    async def client() -> None:
        for i in next_index:
            t0 = time.perf_counter()
            outputs[i] = await send(work[i])
            latencies[i] = time.perf_counter() - t0

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return outputs, latencies


# --- through real processes -------------------------------------------------------------------


async def grpc_generate(stub, w: Work) -> list[int]:
    req = scheduler_pb2.GenerateRequest(prompt_token_ids=w.prompt)
    req.sampling_params.max_tokens = w.max_tokens
    req.sampling_params.temperature = 0.0
    req.sampling_params.ignore_eos = True
    tokens: list[int] = []
    async for resp in stub.Generate(req):
        tokens.extend(resp.token_ids)
        if resp.finish_reason not in (common_pb2.FINISH_REASON_UNSPECIFIED, common_pb2.FINISH_REASON_LENGTH):
            raise RuntimeError(f"request finished with {resp.finish_reason}")
    return tokens


async def grpc_run(stack: Stack, arm: str, repeat: int, work: list[Work], concurrency: int) -> RunResult:
    async with aio_channel(stack.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        before = await stub.GetStats(scheduler_pb2.GetStatsRequest())
        cpu_before = stack_cpu(stack)
        t0 = time.perf_counter()
        outputs, latencies = await closed_loop(work, concurrency, lambda w: grpc_generate(stub, w))
        wall_s = time.perf_counter() - t0
        cpu_after = stack_cpu(stack)
        after = await stub.GetStats(scheduler_pb2.GetStatsRequest())
    busy_s = [(a.stats.busy_ns - b.stats.busy_ns) / 1e9 for b, a in zip(before.stages, after.stages, strict=True)]
    for b, a in zip(before.stages, after.stages, strict=True):
        if a.stats.epoch != b.stats.epoch:
            raise RuntimeError(f"stage {a.stage_index} restarted during the run")
    return RunResult(
        path="grpc",
        arm=arm,
        repeat=repeat,
        async_scheduling=after.config.async_scheduling,
        wall_s=wall_s,
        num_requests=len(work),
        num_output_tokens=sum(len(o) for o in outputs),
        num_expected_output_tokens=sum(w.max_tokens for w in work),
        stage_busy_s=busy_s,
        stage_busy_fraction=[b / wall_s for b in busy_s],
        end_busy_fraction=[s.busy_fraction for s in after.stages],
        num_micro_batches=after.num_micro_batches - before.num_micro_batches,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        latency_p50_s=percentile(latencies, 50),
        latency_p90_s=percentile(latencies, 90),
        cpu_s={name: cpu_after[name] - cpu_before[name] for name in cpu_before},
        outputs=outputs,
    )


def start_arm(model_dir: Path, arm: str, args: argparse.Namespace, log_dir: Path) -> Stack:
    scheduler_args = [
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    if arm == "sync":
        scheduler_args.append("--no-async-scheduling")
    arm_logs = log_dir / arm
    arm_logs.mkdir(parents=True, exist_ok=True)
    return start_stack(
        str(model_dir),
        num_stages=NUM_STAGES,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        log_dir=arm_logs,
        scheduler_args=scheduler_args,
        threads_per_worker=1,
    )


async def grpc_warmup(stack: Stack, work: list[Work], concurrency: int) -> None:
    async with aio_channel(stack.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        await closed_loop(work, concurrency, lambda w: grpc_generate(stub, w))


def bench_grpc(
    model_dir: Path, args: argparse.Namespace, works: list[list[Work]], warmup: list[Work]
) -> list[RunResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-scheduler-") as tmp:
        stacks: dict[str, Stack] = {}
        try:
            for arm in ARMS:
                log(f"starting the {arm} stack ...")
                stacks[arm] = start_arm(model_dir, arm, args, Path(tmp))
            for arm in ARMS:
                asyncio.run(grpc_warmup(stacks[arm], warmup, args.concurrency))
            for repeat, work in enumerate(works):
                order = ARMS if repeat % 2 == 0 else tuple(reversed(ARMS))
                for arm in order:
                    r = asyncio.run(grpc_run(stacks[arm], arm, repeat, work, args.concurrency))
                    log(
                        f"grpc {arm} repeat {repeat}: {r.wall_s:.2f} s, {r.output_tokens_per_s:.0f} tok/s, "
                        f"busy {', '.join(f'{b:.2f}' for b in r.stage_busy_fraction)}"
                    )
                    results.append(r)
        finally:
            for stack in stacks.values():
                stack.stop()
    return results


# --- in process ------------------------------------------------------------------------------


async def local_run(
    model_dir: Path, arm: str, repeats: list[tuple[int, list[Work]]], warmup: list[Work], args: argparse.Namespace
) -> list[RunResult]:
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.request import Request, SamplingOptions
    from wiring.local_engine import build_local_engine

    config = SchedulerConfig(
        model=str(model_dir),
        pipeline_parallel_size=NUM_STAGES,
        async_scheduling=arm == "async",
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
    )
    engine = build_local_engine(str(model_dir), config, num_kv_blocks=args.num_kv_blocks)
    ids = iter(range(1 << 30))

    async def send(w: Work) -> list[int]:
        options = SamplingOptions(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=True)
        stream = engine.submit(Request(f"bench-{next(ids)}", tuple(w.prompt), options, arrival_s=0.0))
        tokens: list[int] = []
        async for out in stream:
            if out.error is not None:
                raise RuntimeError(f"request failed: {out.error}")
            for d in out.deltas:
                tokens.extend(d.token_ids)
        return tokens

    await engine.start()
    results = []
    try:
        await closed_loop(warmup, args.concurrency, send)
        for repeat, work in repeats:
            busy_before = list(engine.transport.busy_ns)
            mb_before = engine.num_micro_batches
            preempt_before = engine.planner.num_preemptions
            cpu_before = cpu_seconds()
            t0 = time.perf_counter()
            outputs, latencies = await closed_loop(work, args.concurrency, send)
            wall_s = time.perf_counter() - t0
            cpu_s = {"engine": cpu_seconds() - cpu_before}
            busy_s = [(a - b) / 1e9 for b, a in zip(busy_before, engine.transport.busy_ns, strict=True)]
            results.append(
                RunResult(
                    path="in-process",
                    arm=arm,
                    repeat=repeat,
                    async_scheduling=engine.config.is_async,
                    wall_s=wall_s,
                    num_requests=len(work),
                    num_output_tokens=sum(len(o) for o in outputs),
                    num_expected_output_tokens=sum(w.max_tokens for w in work),
                    stage_busy_s=busy_s,
                    stage_busy_fraction=[b / wall_s for b in busy_s],
                    num_micro_batches=engine.num_micro_batches - mb_before,
                    num_preemptions=engine.planner.num_preemptions - preempt_before,
                    latency_p50_s=percentile(latencies, 50),
                    latency_p90_s=percentile(latencies, 90),
                    cpu_s=cpu_s,
                    outputs=outputs,
                )
            )
            r = results[-1]
            log(f"in-process {arm} repeat {repeat}: {r.wall_s:.2f} s, {r.output_tokens_per_s:.0f} tok/s")
    finally:
        await engine.stop()
    return results


def bench_local(
    model_dir: Path, args: argparse.Namespace, works: list[list[Work]], warmup: list[Work]
) -> list[RunResult]:
    results = []
    for arm in ARMS:  # one engine per arm, alive for all its repeats
        log(f"in-process {arm} ...")
        results += asyncio.run(local_run(model_dir, arm, list(enumerate(works)), warmup, args))
    return results


# --- report ----------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict:
    return {
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpc": grpc.__version__,
    }


def summarize(results: list[RunResult]) -> list[dict]:
    """Per path and arm: medians over repeats; then async/sync ratios per path."""
    rows = []
    for path in ("grpc", "in-process"):
        by_arm = {arm: [r for r in results if r.path == path and r.arm == arm] for arm in ARMS}
        if not all(by_arm.values()):
            continue
        med = {}
        for arm, runs in by_arm.items():
            num_stages = len(runs[0].stage_busy_fraction)
            med[arm] = {
                "path": path,
                "arm": arm,
                "async_scheduling": sorted({r.async_scheduling for r in runs}),
                "repeats": len(runs),
                "wall_s": statistics.median(r.wall_s for r in runs),
                "requests_per_s": statistics.median(r.requests_per_s for r in runs),
                "output_tokens_per_s": statistics.median(r.output_tokens_per_s for r in runs),
                "stage_busy_fraction": [
                    statistics.median(r.stage_busy_fraction[i] for r in runs) for i in range(num_stages)
                ],
                "end_busy_fraction": (
                    [statistics.median(r.end_busy_fraction[i] for r in runs) for i in range(num_stages)]
                    if runs[0].end_busy_fraction
                    else []
                ),
                "num_micro_batches": statistics.median(r.num_micro_batches for r in runs),
                "num_preemptions": sum(r.num_preemptions for r in runs),
                "num_output_tokens": [r.num_output_tokens for r in runs],
                "latency_p50_s": statistics.median(r.latency_p50_s for r in runs),
                "latency_p90_s": statistics.median(r.latency_p90_s for r in runs),
                "cpu_s": {name: statistics.median(r.cpu_s[name] for r in runs) for name in runs[0].cpu_s},
                "cpu_s_per_1k_tokens": statistics.median(
                    1000 * sum(r.cpu_s.values()) / r.num_output_tokens for r in runs
                ),
                "cores_used": statistics.median(sum(r.cpu_s.values()) / r.wall_s for r in runs),
            }
            rows.append(med[arm])
        a, s = med["async"], med["sync"]
        same = [
            sum(x == y for x, y in zip(ra.outputs, rs.outputs, strict=True))
            for ra, rs in zip(by_arm["async"], by_arm["sync"], strict=True)
        ]
        rows.append(
            {
                "path": path,
                "arm": "async/sync",
                "requests_per_s": a["requests_per_s"] / s["requests_per_s"],
                "output_tokens_per_s": a["output_tokens_per_s"] / s["output_tokens_per_s"],
                "stage_busy_fraction": [
                    x / y if y else float("nan")
                    for x, y in zip(a["stage_busy_fraction"], s["stage_busy_fraction"], strict=True)
                ],
                "latency_p50_s": a["latency_p50_s"] / s["latency_p50_s"],
                "cpu_s_per_1k_tokens": a["cpu_s_per_1k_tokens"] / s["cpu_s_per_1k_tokens"],
                "same_output_tokens": a["num_output_tokens"] == s["num_output_tokens"],
                "num_identical_outputs": same,
            }
        )
    return rows


def markdown(report: dict) -> str:
    rows = report["summary"]
    num_stages = max(len(r["stage_busy_fraction"]) for r in rows)
    busy_head = " | ".join(f"stage {i} busy" for i in range(num_stages))
    lines = [
        f"| path | arm | async_scheduling (GetStats) | wall s | req/s | out tok/s | {busy_head} "
        "| micro-batches | preemptions | latency p50 / p90 s |",
        "|" + "---|" * (9 + num_stages),
    ]
    for r in rows:
        if r["arm"] == "async/sync":
            busy = " | ".join(f"{b:.2f}x" for b in r["stage_busy_fraction"])
            lines.append(
                f"| {r['path']} | **async/sync** | | | **{r['requests_per_s']:.2f}x** | "
                f"**{r['output_tokens_per_s']:.2f}x** | {busy} | | | p50 {r['latency_p50_s']:.2f}x |"
            )
            continue
        busy = " | ".join(f"{b:.2f}" for b in r["stage_busy_fraction"])
        flag = "/".join(str(f).lower() for f in r["async_scheduling"])
        lines.append(
            f"| {r['path']} | {r['arm']} | {flag} | {r['wall_s']:.2f} | {r['requests_per_s']:.2f} | "
            f"{r['output_tokens_per_s']:.0f} | {busy} | {r['num_micro_batches']:.0f} | "
            f"{r['num_preemptions']} | {r['latency_p50_s']:.2f} / {r['latency_p90_s']:.2f} |"
        )
    lines += [
        "",
        "| path | arm | end busy_fraction (GetStats) | CPU s during the run, per process | cores used "
        "| CPU s per 1k output tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["arm"] == "async/sync":
            lines.append(f"| {r['path']} | **async/sync** | | | | {r['cpu_s_per_1k_tokens']:.2f}x |")
            continue
        end = ", ".join(f"{b:.2f}" for b in r["end_busy_fraction"]) or "n/a"
        cpu = ", ".join(f"{name} {v:.1f}" for name, v in r["cpu_s"].items())
        lines.append(
            f"| {r['path']} | {r['arm']} | {end} | {cpu} | {r['cores_used']:.2f} | {r['cpu_s_per_1k_tokens']:.2f} |"
        )
    checks = []
    for r in rows:
        if r["arm"] == "async/sync":
            total = report["workload"]["num_requests"]
            checks.append(
                f"{r['path']}: same number of output tokens in both arms: "
                f"{'yes' if r['same_output_tokens'] else 'NO'}; requests with identical greedy tokens "
                f"in both arms, per repeat: {', '.join(f'{n}/{total}' for n in r['num_identical_outputs'])}."
            )
    return "\n".join(lines) + "\n\n" + "\n".join(checks)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="tiny-model preset")
    p.add_argument(
        "--cache-dir", default=None, help="where models are made once (default: $PAGODA_CACHE_DIR or ~/.cache/pagoda)"
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="runs per arm (alternating arms)")
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=defaults.NUM_KV_BLOCKS)
    p.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE)
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--local", action=argparse.BooleanOptionalAction, default=True, help="also run the in-process engine"
    )
    p.add_argument(
        "--grpc", action=argparse.BooleanOptionalAction, default=True, help="run the stack as real processes"
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    if not (args.grpc or args.local):
        p.error("nothing to run: --no-grpc and --no-local")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the in-process engine gets one torch thread, as each worker does
    log(f"making/loading model {args.model} ...")
    model_dir = default_model_dir(cache_dir=args.cache_dir, spec=PRESETS[args.model])
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    works = [
        workload(args.num_requests, args.prompt_len, args.output_len, vocab_size, args.seed + r)
        for r in range(args.repeats)
    ]
    warmup = workload(args.warmup_requests, args.prompt_len, args.output_len, vocab_size, args.seed + 1000)

    report = report_head(args, model_dir, works)
    t0 = time.perf_counter()
    results: list[RunResult] = []
    if args.grpc:
        results += bench_grpc(model_dir, args, works, warmup)
    if args.local:
        results += bench_local(model_dir, args, works, warmup)
    report["loadavg_end"] = os.getloadavg()
    report["elapsed_s"] = time.perf_counter() - t0
    report["runs"] = [r.to_json() for r in results]
    report["summary"] = summarize(results)
    problems = find_problems(results)
    report["problems"] = problems
    print_report(args, report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.out}")
    return 1 if problems else 0


def report_head(args: argparse.Namespace, model_dir: Path, works: list[list[Work]]) -> dict:
    """What the report says before the runs: the machine, the workload and the config."""
    return {
        "machine": machine(),
        "loadavg_start": os.getloadavg(),
        "model": args.model,
        "model_dir": str(model_dir),
        "workload": {
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "prompt_len": list(args.prompt_len),
            "output_len": list(args.output_len),
            "seed": args.seed,
            "repeats": args.repeats,
            "warmup_requests": args.warmup_requests,
            "num_prompt_tokens": [sum(len(w.prompt) for w in work) for work in works],
            "num_output_tokens": [sum(w.max_tokens for w in work) for work in works],
        },
        "config": {
            "pipeline_parallel_size": NUM_STAGES,
            "num_kv_blocks": args.num_kv_blocks,
            "block_size": args.block_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
            "torch_threads_per_stage": 1,
        },
    }


def find_problems(results: list[RunResult]) -> list[str]:
    """Runs short of their expected output tokens; arms whose async_scheduling flag is wrong."""
    bad = [r for r in results if r.num_output_tokens != r.num_expected_output_tokens]
    flags = {(r.arm, r.async_scheduling) for r in results}
    problems = [
        f"{r.path} {r.arm} repeat {r.repeat}: {r.num_output_tokens} output tokens, "
        f"expected {r.num_expected_output_tokens}"
        for r in bad
    ]
    problems += [f"the {arm} arm reports async_scheduling={flag}" for arm, flag in flags if flag != (arm == "async")]
    return problems


def print_report(args: argparse.Namespace, report: dict) -> None:
    m = report["machine"]
    print(
        f"Model `{args.model}`, PP={NUM_STAGES}, 1 torch thread per stage; {args.num_requests} requests "
        f"(prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]} "
        f"tokens, seed {args.seed}), closed loop at concurrency {args.concurrency}, {args.repeats} repeat(s) per "
        f"arm (medians); {m['cpus_usable']} usable cores ({m['cpu_model'] or 'unknown CPU'}), load average "
        f"{report['loadavg_start'][0]:.2f} at start / {report['loadavg_end'][0]:.2f} at end; "
        f"{report['elapsed_s']:.0f} s in all.\n"
    )
    print(markdown(report))
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}")


if __name__ == "__main__":
    sys.exit(main())
