"""The scheduler's planning CPU per micro-batch, in this process: no gRPC, no stages (issue 37).

    .venv/bin/python -m bench.planning_cpu [--pp 4] [--requests 32] [--micro-batches 4000] [--profile]

The planner (`scheduler_svc.core.planner`) and the KV manager (`kvcache_svc.core`), as the
scheduler drives them at `--pp` stages with async scheduling and the last stage feeding the first:
up to `--pp` micro-batches in flight, each result taken in (`on_result`) before the next plan.
`--requests` closed-loop requests with 128-token prompts, alternately 8 and 128 tokens out (the
emulated table's mixed load); a finished one is replaced at once. Prints the CPU per
micro-batch of planning (propose + the KV step + finalize) and of taking results in, and the
KV round trips per micro-batch. Deterministic work, so a change to the planner's hot path
shows here to a few percent where the whole stack's figures move by 10-20%.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from collections import deque

from kvcache_svc.core.manager import KVCacheManager
from scheduler_svc.core.planner import Planner, PlannerConfig
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request
from services.kv_types import StepOutput
from services.sampling import SamplingOptions
from services.step import SampledToken

PROMPT_TOKENS, SHORT_OUTPUT, LONG_OUTPUT = 128, 8, 128


def run(pp: int, num_requests: int, num_micro_batches: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    kv = KVCacheManager(4096, 16)
    planner = Planner(
        PlannerConfig(block_size=16, pipeline_parallel_size=pp, max_in_flight=pp, async_decode=True), WaitingQueue()
    )
    if pp > 1:
        planner.set_feedback(True)
    count = 0

    def add() -> None:
        nonlocal count
        count += 1
        prompt = tuple(rng.randrange(3, 30000) for _ in range(PROMPT_TOKENS))
        max_tokens = SHORT_OUTPUT if count % 2 else LONG_OUTPUT
        planner.add(
            Request(f"r{count}", prompt, SamplingOptions(max_tokens=max_tokens), arrival_s=0.0, eos_token_ids=())
        )

    for _ in range(num_requests):
        add()
    flight: deque = deque()
    done = rows = kv_calls = 0
    plan_s = result_s = 0.0
    while done < num_micro_batches:
        t0 = time.process_time()
        while len(flight) < pp:
            proposal = planner.propose()
            kv_calls += not proposal.skips_kv
            output = StepOutput(results={}, copies=()) if proposal.skips_kv else kv.step(proposal.step_input)
            mb = planner.finalize(proposal, output)
            if mb is None:
                break
            flight.append(mb)
        t1 = time.process_time()
        plan_s += t1 - t0
        if not flight:
            break
        mb = flight.popleft()
        sampled = [SampledToken(s.seq_id, rng.randrange(3, 30000)) for s in mb.seqs if s.sample]
        rows += len(mb.seqs)
        for update in planner.on_result(mb.micro_batch_id, sampled):
            if update.finished and update.seq.request.all_finished:
                add()
        result_s += time.process_time() - t1
        done += 1
    return {
        "pp": pp,
        "requests": num_requests,
        "micro_batches": done,
        "rows_per_micro_batch": rows / max(1, done),
        "kv_calls_per_micro_batch": kv_calls / max(1, done),
        "plan_ms": 1e3 * plan_s / max(1, done),
        "result_ms": 1e3 * result_s / max(1, done),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.planning_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=4000)
    p.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    args = p.parse_args(argv)
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    r = run(args.pp, args.requests, args.micro_batches)
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    print(
        f"PP={r['pp']}, {r['requests']} requests: {r['micro_batches']} micro-batches of "
        f"{r['rows_per_micro_batch']:.1f} rows, {r['kv_calls_per_micro_batch']:.2f} KV round trips each; "
        f"CPU per micro-batch: planning {r['plan_ms']:.3f} ms, results {r['result_ms']:.3f} ms, "
        f"together {r['plan_ms'] + r['result_ms']:.3f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
