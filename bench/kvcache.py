"""Benchmark the KV-cache manager: fragmentation under churn and what a Step call costs.

    .venv/bin/python -m bench.kvcache --out /tmp/bench_kvcache.json

Three parts, each run in-process (`InProcessKVCacheClient`) and over gRPC
(`GrpcKVCacheClient` against a real `pagoda kvcache` process on loopback), through the same
client interface, so both runs make the same calls and must end in the same state:

1. Layout: `--num-seqs` sequences with prompt and output lengths drawn from a fixed-seed
   log-normal distribution (prompt + output <= 4,096 tokens), block size 16, all resident
   at full length: internal fragmentation and blocks per table extent.
2. Churn: the same sequences through a pool that holds about a quarter of them at once, as a
   scheduler would run them: admit while blocks last (at most 8,192 prefill tokens and 256
   sequences per step), decode one token per running sequence per step, free finished ones,
   preempt (free and requeue) a sequence whose append finds no blocks. Internal and external
   fragmentation while the pool is busy, and the Step call's cost per sequence.
3. Growth: pools of 1k, 10k and 100k blocks (prefix caching on), filled to 85% and churned
   (30% freed and refilled, three times), then decode steps of 32 sequences and admission
   steps of 8 sequences (medians over 100 and 40 steps): the cost per sequence as the pool
   grows, with `stats()` and `check_integrity()` (both linear in the pool) for reference.

Not a test: numbers depend on the machine. Prints Markdown tables and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache_svc.client import InProcessKVCacheClient  # noqa: E402
from kvcache_svc.core import Allocated, Append, KVCacheManager, NewSequence, NoBlocks, StepInput  # noqa: E402
from services.defaults import BLOCK_SIZE  # noqa: E402
from services.kv_client import GrpcKVCacheClient, KVCacheClient  # noqa: E402
from wiring.launcher import ServiceProcess, free_port, pagoda_command  # noqa: E402

MAX_LEN = 4096


# ---- workload ------------------------------------------------------------------------------


def draw_lengths(num_seqs: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths: log-normal, median 512 and 128 tokens, sum <= MAX_LEN."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_seqs):
        prompt = min(MAX_LEN - 1, max(1, round(rng.lognormvariate(math.log(512), 1.0))))
        output = min(MAX_LEN - prompt, max(1, round(rng.lognormvariate(math.log(128), 1.0))))
        out.append((prompt, output))
    return out


def tokens(seq_id: int, n: int) -> list[int]:
    return [(seq_id * 7919 + i) % 50_000 for i in range(n)]


@contextlib.asynccontextmanager
async def open_client(kind: str, num_blocks: int, prefix_caching: bool, log_dir: Path) -> AsyncIterator[KVCacheClient]:
    if kind == "in-process":
        manager = KVCacheManager(num_blocks, BLOCK_SIZE, watermark=0.0, enable_prefix_caching=prefix_caching)
        yield InProcessKVCacheClient(manager)
        return
    port = free_port()
    args = [
        "kvcache",
        "--port",
        str(port),
        "--num-blocks",
        str(num_blocks),
        "--block-size",
        str(BLOCK_SIZE),
        "--watermark",
        "0",
    ]
    if not prefix_caching:
        args.append("--no-prefix-caching")
    proc = ServiceProcess(
        "kvcache", pagoda_command(*args), f"127.0.0.1:{port}", log_path=log_dir / f"kvcache-{port}.log"
    )
    proc.start()
    try:
        await asyncio.to_thread(proc.wait_healthy, 60.0)
        client = GrpcKVCacheClient(proc.health_address, timeout_s=60.0)
        try:
            yield client
        finally:
            await client.close()
    finally:
        proc.stop()


@dataclass
class StepTimer:
    """Wall time of Step calls and how many sequence entries they carried."""

    times_s: list[float] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)

    async def step(self, client: KVCacheClient, step: StepInput):
        start = time.perf_counter()
        out = await client.step(step)
        self.times_s.append(time.perf_counter() - start)
        self.entries.append(len(step.appends) + len(step.new_sequences))
        return out

    @property
    def us_per_seq(self) -> float:
        return 1e6 * sum(self.times_s) / max(1, sum(self.entries))

    @property
    def median_us_per_seq(self) -> float:
        """Robust to the odd slow step (a shared machine): the median step's cost per entry."""
        per_seq = [t / n for t, n in zip(self.times_s, self.entries, strict=True) if n]
        return 1e6 * statistics.median(per_seq) if per_seq else 0.0

    @property
    def median_step_ms(self) -> float:
        return 1e3 * statistics.median(self.times_s) if self.times_s else 0.0


# ---- 1. layout at full length ----------------------------------------------------------------


async def layout(client: KVCacheClient, lengths: Sequence[tuple[int, int]]) -> dict:
    timer = StepTimer()
    news = [NewSequence(i, tokens(i, p + o)) for i, (p, o) in enumerate(lengths)]
    out = await timer.step(client, StepInput(new_sequences=news, micro_batch_id=0))
    assert all(isinstance(r, Allocated) for r in out.results.values())
    stats = await client.stats()
    seqs = await client.sequence_stats()
    return {
        "num_blocks": stats.num_blocks,
        "num_tokens": sum(p + o for p, o in lengths),
        "num_used_blocks": stats.num_used_blocks,
        "internal_fragmentation": stats.internal_fragmentation,
        "mean_extents_per_seq": statistics.fmean(s.num_extents for s in seqs),
        "admit_all_us_per_seq": timer.us_per_seq,
        "stats": asdict(stats),
    }


# ---- 2. churn --------------------------------------------------------------------------------


@dataclass
class ChurnQueue:
    """The scheduler's side of the churn run: the sequences waiting, running, to free in the
    next step and preempted (readmitted a step after their free: ids are live until then)."""

    known: dict[int, int]  # tokens to put in a new sequence
    remaining: dict[int, int]  # output tokens still to append
    waiting: deque[int]
    running: set[int] = field(default_factory=set)
    to_free: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @classmethod
    def of(cls, lengths: Sequence[tuple[int, int]]) -> ChurnQueue:
        return cls(
            known={i: p for i, (p, _) in enumerate(lengths)},
            remaining={i: o for i, (_, o) in enumerate(lengths)},
            waiting=deque(range(len(lengths))),
        )

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.to_free or self.preempted)

    def admit(self, max_batched_prefill_tokens: int, max_running: int) -> list[NewSequence]:
        """New sequences from the head of the queue, while the budget and the batch hold them."""
        news: list[NewSequence] = []
        budget = max_batched_prefill_tokens
        while self.waiting and len(self.running) + len(news) < max_running:
            n = self.known[self.waiting[0]]
            if news and n > budget:
                break
            seq_id = self.waiting.popleft()
            news.append(NewSequence(seq_id, tokens(seq_id, n)))
            budget -= n
        return news

    def settle(self, news: list[NewSequence], appends: list[Append], results: dict) -> bool:
        """After a step: requeue the preempted and the new sequences that found no blocks;
        preempt by recompute an append that found none, free the finished. Whether every new
        sequence was admitted."""
        self.waiting.extendleft(reversed(self.preempted))
        self.to_free, self.preempted = [], []
        readmit = []
        for new in news:
            if isinstance(results[new.seq_id], Allocated):
                self.running.add(new.seq_id)
            else:
                readmit.append(new.seq_id)
        self.waiting.extendleft(reversed(readmit))
        for append in appends:
            s = append.seq_id
            if isinstance(results[s], NoBlocks):  # preempt by recompute
                self.running.discard(s)
                self.to_free.append(s)
                self.preempted.append(s)
                self.num_preempted += 1
                continue
            self.known[s] += 1
            self.remaining[s] -= 1
            if self.remaining[s] == 0:
                self.running.discard(s)
                self.to_free.append(s)
        return not readmit


async def churn(
    client: KVCacheClient,
    lengths: Sequence[tuple[int, int]],
    max_batched_prefill_tokens: int = 8192,
    max_running: int = 256,
) -> dict:
    queue = ChurnQueue.of(lengths)
    timer = StepTimer()
    samples: list[tuple[float, float, float, int, int, int]] = []
    micro_batch_id, last_admission_step = 0, 0
    while queue.busy():
        micro_batch_id += 1
        appends = [Append(s, [1 + queue.remaining[s] % 1000]) for s in sorted(queue.running)]
        news = queue.admit(max_batched_prefill_tokens, max_running)
        step = StepInput(
            new_sequences=news,
            appends=appends,
            frees=queue.to_free,
            completed_micro_batch_ids=[micro_batch_id - 1] if micro_batch_id > 1 else [],
            micro_batch_id=micro_batch_id,
        )
        out = await timer.step(client, step)
        if queue.settle(news, appends, out.results) and news:
            last_admission_step = micro_batch_id
        if micro_batch_id % 10 == 0:
            stats = await client.stats()
            seqs = await client.sequence_stats()
            extents = statistics.fmean(q.num_extents for q in seqs) if seqs else 0.0
            samples.append(
                (
                    stats.internal_fragmentation,
                    stats.external_fragmentation,
                    extents,
                    micro_batch_id,
                    stats.num_free_blocks,
                    stats.num_free_extents,
                )
            )
    # the busy phase: from a quarter of the admissions to the last one
    busy = [s for s in samples if last_admission_step // 4 <= s[3] <= last_admission_step]
    at_last = min(samples, key=lambda s: abs(s[3] - last_admission_step))
    final = await client.stats()
    return {
        "num_steps": micro_batch_id,
        "num_preempted": queue.num_preempted,
        "last_admission_step": last_admission_step,
        "busy_internal_fragmentation": statistics.fmean(s[0] for s in busy),
        "busy_external_fragmentation": statistics.fmean(s[1] for s in busy),
        "busy_max_external_fragmentation": max(s[1] for s in busy),
        "busy_mean_extents_per_seq": statistics.fmean(s[2] for s in busy),
        "busy_mean_free_blocks": statistics.fmean(s[4] for s in busy),
        "busy_mean_free_extents": statistics.fmean(s[5] for s in busy),
        "external_fragmentation_at_last_admission": at_last[1],
        "step_us_per_seq": timer.us_per_seq,
        "median_step_ms": timer.median_step_ms,
        "mean_seqs_per_step": statistics.fmean(timer.entries),
        "final_stats": asdict(final),
    }


# ---- 3. growth with the pool size ------------------------------------------------------------


async def growth(client: KVCacheClient, num_blocks: int, seed: int) -> dict:
    rng = random.Random(seed)
    live: dict[int, int] = {}
    next_id, mb = 0, 0

    async def step(timer: StepTimer | None = None, **fields) -> dict:
        nonlocal mb
        mb += 1
        s = StepInput(completed_micro_batch_ids=[mb - 1] if mb > 1 else [], micro_batch_id=mb, **fields)
        return (await timer.step(client, s) if timer else await client.step(s)).results

    async def fill(target_used: int) -> None:
        nonlocal next_id
        used = (await client.stats()).num_used_blocks
        while used < target_used:
            news = []
            while used < target_used and len(news) < 256:
                n = rng.randint(32, 512)
                news.append(NewSequence(next_id, tokens(next_id, n)))
                live[next_id] = n
                next_id += 1
                used += -(-n // BLOCK_SIZE)
            await step(new_sequences=news)

    await fill(int(0.85 * num_blocks))
    for _ in range(3):
        victims = rng.sample(sorted(live), len(live) * 3 // 10)
        await client.free(victims)
        for v in victims:
            del live[v]
        await fill(int(0.85 * num_blocks))
    stats = await client.stats()

    decode_ids = rng.sample(sorted(live), min(32, len(live)))
    decode = StepTimer()
    for i in range(110):
        await step(decode if i >= 10 else None, appends=[Append(s, [i + 1]) for s in decode_ids])
    admit = StepTimer()
    for i in range(45):
        ids = list(range(next_id, next_id + 8))
        next_id += 8
        results = await step(admit if i >= 5 else None, new_sequences=[NewSequence(s, tokens(s, 128)) for s in ids])
        await client.free([s for s in ids if isinstance(results[s], Allocated)])
    start = time.perf_counter()
    for _ in range(3):
        await client.stats()
    stats_ms = 1e3 * (time.perf_counter() - start) / 3
    return {
        "num_blocks": num_blocks,
        "num_sequences": stats.num_sequences,
        "num_free_extents": stats.num_free_extents,
        "num_evictable_blocks": stats.num_evictable_blocks,
        "external_fragmentation": stats.external_fragmentation,
        "decode_us_per_seq": decode.median_us_per_seq,
        "decode_step_ms": decode.median_step_ms,
        "admit_us_per_seq": admit.median_us_per_seq,
        "admit_step_ms": admit.median_step_ms,
        "stats_ms": stats_ms,
    }


def time_integrity(num_blocks: int, seed: int) -> float:
    """`check_integrity()` on a churned pool, in ms (in-process only: the service runs it
    when idle)."""
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, watermark=0.0)
    asyncio.run(growth(InProcessKVCacheClient(manager), num_blocks, seed))
    start = time.perf_counter()
    manager.check_integrity()
    return 1e3 * (time.perf_counter() - start)


# ---- report ----------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    lay, ch, gr = result["layout"], result["churn"], result["growth"]
    lines = [
        f"Workload: {result['num_seqs']} sequences, seed {result['seed']}, block size "
        f"{BLOCK_SIZE}; prompt median {result['prompt_median']}, output median "
        f"{result['output_median']}, longest {result['longest']} tokens; "
        f"{lay['in-process']['num_tokens']:,} tokens in all.",
        "",
        "| measure | in-process | gRPC |",
        "|---|---:|---:|",
    ]

    def row(name: str, part: dict, key: str, fmt: str) -> None:
        values = [format(part[k][key], fmt) if k in part else "-" for k in ("in-process", "grpc")]
        lines.append(f"| {name} | {values[0]} | {values[1]} |")

    row("all resident: internal fragmentation", lay, "internal_fragmentation", ".4f")
    row("all resident: extents per sequence", lay, "mean_extents_per_seq", ".2f")
    row("all resident: admit all in one Step, us/seq", lay, "admit_all_us_per_seq", ".1f")
    pool = result["churn_pool_blocks"]
    row(f"churn ({pool:,} blocks): internal fragmentation (busy mean)", ch, "busy_internal_fragmentation", ".4f")
    row("churn: external fragmentation (busy mean)", ch, "busy_external_fragmentation", ".3f")
    row("churn: external fragmentation (busy max)", ch, "busy_max_external_fragmentation", ".3f")
    row("churn: external fragmentation at last admission", ch, "external_fragmentation_at_last_admission", ".3f")
    row("churn: free blocks (busy mean)", ch, "busy_mean_free_blocks", ".0f")
    row("churn: free extents (busy mean)", ch, "busy_mean_free_extents", ".0f")
    row("churn: extents per sequence (busy mean)", ch, "busy_mean_extents_per_seq", ".2f")
    row("churn: preemptions", ch, "num_preempted", "d")
    row("churn: Step calls", ch, "num_steps", "d")
    row("churn: sequences per Step (mean)", ch, "mean_seqs_per_step", ".0f")
    row("churn: Step cost, us per sequence", ch, "step_us_per_seq", ".1f")
    row("churn: Step median, ms", ch, "median_step_ms", ".2f")
    lines += [
        "",
        "| pool blocks | live seqs | free extents | evictable | decode us/seq (in-proc / gRPC) "
        "| decode step ms | admit us/seq (in-proc / gRPC) | admit step ms | stats() ms "
        "| check_integrity() ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, size in enumerate(result["sizes"]):
        a = gr["in-process"][i]
        b = gr["grpc"][i] if "grpc" in gr else None

        def pair(key: str, fmt: str, a=a, b=b) -> str:
            return f"{a[key]:{fmt}} / {b[key]:{fmt}}" if b else f"{a[key]:{fmt}} / -"

        lines.append(
            f"| {size:,} | {a['num_sequences']:,} | {a['num_free_extents']:,} "
            f"| {a['num_evictable_blocks']:,} | {pair('decode_us_per_seq', '.1f')} "
            f"| {pair('decode_step_ms', '.2f')} | {pair('admit_us_per_seq', '.1f')} "
            f"| {pair('admit_step_ms', '.2f')} | {pair('stats_ms', '.2f')} "
            f"| {result['integrity_ms'][i]:.1f} |"
        )
    return "\n".join(lines)


async def run_all(args: argparse.Namespace, log_dir: Path) -> dict:
    lengths = draw_lengths(args.num_seqs, args.seed)
    total_blocks = sum(-(-(p + o) // BLOCK_SIZE) for p, o in lengths)
    churn_pool = total_blocks // 4
    kinds = ["in-process"] + ([] if args.no_grpc else ["grpc"])
    result: dict = {
        "num_seqs": args.num_seqs,
        "seed": args.seed,
        "block_size": BLOCK_SIZE,
        "prompt_median": statistics.median(p for p, _ in lengths),
        "output_median": statistics.median(o for _, o in lengths),
        "longest": max(p + o for p, o in lengths),
        "churn_pool_blocks": churn_pool,
        "sizes": args.sizes,
        "layout": {},
        "churn": {},
        "growth": {},
    }
    for kind in kinds:
        print(f"[{kind}] layout, churn, growth ...", file=sys.stderr, flush=True)
        async with open_client(kind, total_blocks, False, log_dir) as client:
            result["layout"][kind] = await layout(client, lengths)
        async with open_client(kind, churn_pool, False, log_dir) as client:
            result["churn"][kind] = await churn(client, lengths)
        result["growth"][kind] = []
        for size in args.sizes:
            async with open_client(kind, size, True, log_dir) as client:
                result["growth"][kind].append(await growth(client, size, args.seed))
    if "grpc" in kinds:  # the same calls must have left the same state
        for part in ("layout", "churn"):
            key = "stats" if part == "layout" else "final_stats"
            same = result[part]["grpc"][key] == result[part]["in-process"][key]
            result[f"{part}_same_state"] = same
            if not same:
                print(f"WARNING: {part}: gRPC and in-process states differ", file=sys.stderr)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="1024,10240,102400", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--no-grpc", action="store_true", help="in-process only")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-kvcache-") as log_dir:
        result = asyncio.run(run_all(args, Path(log_dir)))
    result["integrity_ms"] = [time_integrity(size, args.seed) for size in args.sizes]
    result["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
        "seconds": time.perf_counter() - started,
    }
    print(markdown(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
