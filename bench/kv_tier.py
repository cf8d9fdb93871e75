"""A multi-turn chat workload whose working set is several times the KV pool, with and without
the KV tier below it (`--kv-offload`, issue 39), on the real model, in one run.

C conversations take turns: each turn sends the whole history (a system prompt of its own, then
every user message and answer so far) plus a new user message, and appends the greedy answer.
Conversations go round-robin, one request at a time, so by the time a conversation comes back
the pool has been filled by the others: without a tier its prefix is gone (recomputed); with
one it is loaded from host memory or disk. Token ids are random (the KV work is the same as a
chat's). Per arm it reports the time to first token of the turns after the first (mean, p50,
p90), the prompt tokens computed, those found in the pool and in the tier, and the tier's
hit rate, and how many answers equal the first arm's (greedy: with `--dtype float32` a tier arm
changes no answer but at a near-tie). Arms run in the same process, one after the other, each on
a fresh engine.

    python -m bench.kv_tier [--model GGUF_OR_DIR] [--conversations 8] [--turns 6] [--ratio 4]

`--preempt` measures the other use instead: a burst of long requests on a pool too small for
them, so the scheduler preempts (recompute); with a tier, a preempted sequence's evicted full
blocks come back as loads when it is re-admitted (swap instead of recompute). It reports the
burst's wall time, the prompt tokens computed, preemptions and tier hits per arm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

BLOCK = 16


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the real model's GGUF (SmolLM2-135M Q4_1)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=192)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--ratio", type=float, default=4.0, help="the working set over the pool")
    ap.add_argument("--arms", default="none,host,host+disk")
    ap.add_argument("--disk-dir", default="/tmp/pagoda-kv-tier-bench")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--preempt", action="store_true", help="the preemption burst instead of the chats")
    ap.add_argument("--requests", type=int, default=16, help="--preempt: requests in the burst")
    ap.add_argument("--prompt-tokens", type=int, default=320, help="--preempt: each prompt")
    ap.add_argument("--max-tokens", type=int, default=96, help="--preempt: each answer")
    return ap.parse_args()


def working_set_blocks(args) -> int:
    history = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    return args.conversations * -(-history // BLOCK)


def offload_of(arm: str, args, blocks: int) -> str:
    if arm == "none":
        return ""
    if arm == "host":
        return f"host:{blocks}b"
    return f"host:{max(1, blocks // 4)}b,disk:{args.disk_dir}:{blocks}b"  # most of it on disk


async def run_arm(model_dir: str, args, arm: str, pool: int, tier_blocks: int) -> dict:
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.request import Request, SamplingOptions
    from wiring.local_engine import build_local_engine

    config = SchedulerConfig(
        block_size=BLOCK,
        num_kv_blocks=pool,
        max_num_batched_tokens=512,
        kv_offload=offload_of(arm, args, tier_blocks),
        async_scheduling=False,
    )
    engine = build_local_engine(model_dir, config, num_kv_blocks=pool, dtype=args.dtype)
    rng = random.Random(0)
    histories = [[rng.randrange(100, 40000) for _ in range(args.system_tokens)] for _ in range(args.conversations)]
    answer = SamplingOptions(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    ttfts, computed, prompt_tokens, n, answers = [], 0, 0, 0, []
    await engine.start()
    try:
        for turn in range(args.turns):
            for c, history in enumerate(histories):
                history += [rng.randrange(100, 40000) for _ in range(args.user_tokens)]
                n += 1
                began, first, tokens, final = time.perf_counter(), None, [], None
                async for out in engine.submit(Request(f"c{c}t{turn}", tuple(history), answer, 0.0)):
                    if first is None and any(d.token_ids for d in out.deltas):
                        first = time.perf_counter() - began
                    for d in out.deltas:
                        tokens.extend(d.token_ids)
                    final = out
                assert final.error is None, final.error
                history += tokens
                answers.append(tokens)
                if turn:
                    ttfts.append(first)
                    prompt_tokens += len(history) - len(tokens)
                    computed += len(history) - len(tokens) - final.num_cached_tokens
        kv = await engine.kv.stats()
    finally:
        await engine.stop()
    ttfts.sort()
    return {
        "arm": arm,
        "kv_offload": config.kv_offload,
        "ttft_mean_ms": 1e3 * sum(ttfts) / len(ttfts),
        "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2],
        "ttft_p90_ms": 1e3 * ttfts[int(len(ttfts) * 0.9)],
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": computed,
        "pool_hit_tokens": kv.num_prefix_hit_tokens,
        "tier_hit_tokens": kv.num_tier_hit_tokens,
        "tier_hit_rate": kv.num_tier_hit_tokens / kv.num_prefix_query_tokens if kv.num_prefix_query_tokens else 0.0,
        "tier_saves": kv.num_tier_saves,
        "tier_demotions": kv.num_tier_demotions,
        "answers": answers,
    }


async def run_burst(model_dir: str, args, arm: str, pool: int, tier_blocks: int) -> dict:
    """Every request at once on `pool` blocks: preemption by recompute, with or without a tier."""
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.request import Request, SamplingOptions
    from wiring.local_engine import build_local_engine

    config = SchedulerConfig(
        block_size=BLOCK,
        num_kv_blocks=pool,
        max_num_batched_tokens=512,
        kv_offload=offload_of(arm, args, tier_blocks),
        async_scheduling=False,
    )
    engine = build_local_engine(model_dir, config, num_kv_blocks=pool, dtype=args.dtype)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    options = SamplingOptions(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def collect(stream):
        tokens, final = [], None
        async for out in stream:
            for d in out.deltas:
                tokens.extend(d.token_ids)
            final = out
        assert final.error is None, final.error
        return tokens

    await engine.start()
    try:
        began = time.perf_counter()
        answers = await asyncio.gather(
            *(collect(engine.submit(Request(f"b{i}", tuple(p), options, 0.0))) for i, p in enumerate(prompts))
        )
        wall = time.perf_counter() - began
        kv, preemptions = await engine.kv.stats(), engine.planner.num_preemptions
    finally:
        await engine.stop()
    return {
        "arm": arm,
        "kv_offload": config.kv_offload,
        "wall_s": wall,
        "preemptions": preemptions,
        "prompt_tokens_computed": kv.num_prefix_query_tokens - kv.num_prefix_hit_tokens - kv.num_tier_hit_tokens,
        "pool_hit_tokens": kv.num_prefix_hit_tokens,
        "tier_hit_tokens": kv.num_tier_hit_tokens,
        "answers": answers,
    }


def burst_main(args, model_dir: str) -> None:
    need = args.requests * -(-(args.prompt_tokens + args.max_tokens) // BLOCK)
    pool = max(-(-(args.prompt_tokens + args.max_tokens) // BLOCK) + 2, need // 4)
    print(
        f"{args.requests} requests of {args.prompt_tokens} -> {args.max_tokens} at once on {pool} blocks ({need} needed)"
    )
    results = [asyncio.run(run_burst(model_dir, args, arm, pool, need)) for arm in args.arms.split(",")]
    base = results[0]
    for r in results:
        same = sum(a == b for a, b in zip(r["answers"], base["answers"], strict=True))
        print(
            f"{r['arm']:<10} wall {r['wall_s']:>7.2f} s ({base['wall_s'] / r['wall_s']:.2f}x)  preemptions "
            f"{r['preemptions']:>4}  prompt tokens computed {r['prompt_tokens_computed']:>7}  pool hits "
            f"{r['pool_hit_tokens']:>6}  tier hits {r['tier_hit_tokens']:>6}  answers equal: {same}/{len(r['answers'])}"
        )
    if args.out:
        args.out.write_text(json.dumps({"pool_blocks": pool, "arms": results}, indent=1))


def main() -> None:
    args = parse_args()
    import torch  # (its threads as OMP_NUM_THREADS sets them: run with 1)

    from wiring.model_source import default_model, prepare_gguf

    path = args.model or str(default_model(log=lambda line: None))
    model_dir = str(prepare_gguf(path)) if path.endswith(".gguf") else path
    if args.preempt:
        burst_main(args, model_dir)
        return
    blocks = working_set_blocks(args)
    pool = max(-(-(args.system_tokens + args.turns * 80) // BLOCK) + 4, int(blocks / args.ratio))
    print(f"model {path}; {args.conversations} conversations x {args.turns} turns; working set {blocks} blocks,")
    print(f"pool {pool} blocks of {BLOCK} ({blocks / pool:.1f}x); torch threads {torch.get_num_threads()}")
    results = [asyncio.run(run_arm(model_dir, args, arm, pool, blocks)) for arm in args.arms.split(",")]
    base = results[0]
    print(
        f"{'arm':<10} {'TTFT mean':>10} {'p50':>8} {'p90':>8} {'computed':>9} {'pool hit':>9} {'tier hit':>9} "
        f"{'tier rate':>9} {'TTFT vs ' + base['arm']:>14}"
    )
    for r in results:
        same = sum(a == b for a, b in zip(r["answers"], base["answers"], strict=True))
        r["answers_equal_to_" + base["arm"]] = f"{same}/{len(base['answers'])}"
        print(
            f"{r['arm']:<10} {r['ttft_mean_ms']:>8.1f}ms {r['ttft_p50_ms']:>6.1f}ms {r['ttft_p90_ms']:>6.1f}ms "
            f"{r['prefill_tokens_computed']:>9} {r['pool_hit_tokens']:>9} {r['tier_hit_tokens']:>9} "
            f"{r['tier_hit_rate']:>9.2f} {base['ttft_mean_ms'] / r['ttft_mean_ms']:>13.2f}x"
            f"  answers equal to {base['arm']}: {r['answers_equal_to_' + base['arm']]}"
        )
    if args.out:
        args.out.write_text(json.dumps({"pool_blocks": pool, "working_set_blocks": blocks, "arms": results}, indent=1))


if __name__ == "__main__":
    main()
