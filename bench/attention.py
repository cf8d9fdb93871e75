"""Benchmark the torch attention backend's decode path against the paths it replaced.

    .venv/bin/python -m bench.attention [--threads 1] [--out /tmp/bench_attention.json]

One decode step of one layer (every row a single new token; K/V in a paged pool of blocks
of 16 with the blocks shuffled), float32 on the CPU, for shapes from the tiny model to the
25M model and longer contexts. Three implementations, all in this run:

- `per_seq`: one SDPA call per sequence, K/V repeated for GQA (the path before session 2
  for contexts over 16,384 elements);
- `one_batch`: every row padded into one batch, two matmuls and a masked softmax (the path
  before session 2 for small contexts);
- `backend`: `TorchAttentionBackend.forward` (decode groups of <= DECODE_GROUP_MAX_ELEMENTS
  padded K elements, one SDPA call with GQA each), plan included.

Prints milliseconds (median of the repetitions) and the speedup of the backend over the
better of the two old paths; checks that all three agree.

`--engine` adds end-to-end runs of the in-process engine (PP=1, sync scheduling): 64 greedy
requests of 32 prompt and 128 output tokens on the tiny and 25M models, once with the
backend and once with `LegacyBackend` (the old dispatch: one batch up to 16,384 elements of
context, else per sequence), alternating, best of `--engine-repeats`; both must produce the
same tokens. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from services.defaults import BLOCK_SIZE
from worker_svc.kernels.attention import AttentionMetadata, TorchAttentionBackend

# (name, sequences, max context, kv heads, heads, head dim)
SHAPES = [
    ("tiny model, 64 rows", 64, 96, 2, 4, 16),
    ("tiny model, 16 rows", 16, 96, 2, 4, 16),
    ("25M model, 64 rows", 64, 192, 4, 8, 64),
    ("25M model, 16 rows, ctx 600", 16, 600, 4, 8, 64),
    ("25M model, 64 rows, ctx 1000", 64, 1000, 4, 8, 64),
    ("no GQA, 32 rows, ctx 400", 32, 400, 8, 8, 64),
]


def make_step(num_seqs, max_ctx, kv_heads, heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(max_ctx // 4, max_ctx + 1, (num_seqs,), generator=g).tolist()
    per_seq = -(-max_ctx // BLOCK_SIZE)
    num_blocks = num_seqs * per_seq + 1
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: num_seqs * per_seq].view(num_seqs, per_seq)
    k_pool = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=g)
    v_pool = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=g)
    q = torch.randn(num_seqs, heads, head_dim, generator=g)
    starts = tuple(range(num_seqs + 1))

    def metadata():  # fresh per call: the backend's per-step plan is part of what is timed
        return AttentionMetadata(
            slot_mapping=torch.zeros(num_seqs, dtype=torch.long),
            query_start_loc=torch.tensor(starts),
            context_lens=torch.tensor(ctx),
            block_tables=tables,
            query_start_loc_list=starts,
            context_lens_list=tuple(ctx),
        )

    return q, k_pool, v_pool, ctx, tables, metadata


def per_seq(q, k_pool, v_pool, ctx, tables, scale):
    kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    for i, c in enumerate(ctx):
        blocks = tables[i, : -(-c // BLOCK_SIZE)]
        k = k_pool[blocks].reshape(-1, kv_heads, head_dim)[:c].repeat_interleave(group, dim=1)
        v = v_pool[blocks].reshape(-1, kv_heads, head_dim)[:c].repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(
            q[i : i + 1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale
        )
        out[i] = o.transpose(0, 1)[0]
    return out


def one_batch(q, k_pool, v_pool, ctx, tables, scale):
    n, kv_heads, head_dim = len(ctx), k_pool.shape[2], k_pool.shape[3]
    group = q.shape[1] // kv_heads
    max_ctx = max(ctx)
    blocks = -(-max_ctx // BLOCK_SIZE)
    k = k_pool[tables[:, :blocks]].view(n, blocks * BLOCK_SIZE, kv_heads, head_dim)[:, :max_ctx]
    v = v_pool[tables[:, :blocks]].view(n, blocks * BLOCK_SIZE, kv_heads, head_dim)[:, :max_ctx]
    scores = torch.matmul(q.view(n, kv_heads, group, head_dim), k.permute(0, 2, 3, 1)) * scale
    keep = torch.arange(max_ctx)[None, :] < torch.tensor(ctx)[:, None]
    scores.masked_fill_(~keep[:, None, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), v.permute(0, 2, 1, 3))
    return o.reshape(n, kv_heads * group, head_dim)


class LegacyBackend(TorchAttentionBackend):
    """The decode dispatch before decode groups, for the end-to-end comparison."""

    def forward(self, q, k_pool, v_pool, metadata, scale, sliding_window):
        starts, ctx_lens = metadata.query_start_loc_list, metadata.context_lens_list
        if sliding_window is not None or any(starts[i + 1] - starts[i] != 1 for i in range(len(ctx_lens))):
            return super().forward(q, k_pool, v_pool, metadata, scale, sliding_window)
        path = one_batch if max(ctx_lens) * k_pool.shape[2] * k_pool.shape[3] <= 16_384 else per_seq
        return path(q, k_pool, v_pool, list(ctx_lens), metadata.block_tables, scale)


def engine_runs(repeats: int) -> list[dict]:
    import asyncio

    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.core.request import Request, SamplingOptions
    from wiring.local_engine import _collect, build_local_engine
    from wiring.tiny_model import PRESETS, default_model_dir

    async def run(model, backend, prompts):
        config = SchedulerConfig(model=model, num_kv_blocks=2048, async_scheduling=False, max_num_seqs=64)
        engine = build_local_engine(model, config, 2048, attention_backend=backend)
        await engine.start()
        try:
            options = SamplingOptions(max_tokens=128, temperature=0.0, ignore_eos=True)
            started = time.perf_counter()
            streams = [engine.submit(Request(f"r{i}", tuple(p), options, arrival_s=0.0)) for i, p in enumerate(prompts)]
            results = await asyncio.gather(*(_collect(s) for s in streams))
            seconds = time.perf_counter() - started
        finally:
            await engine.stop()
        tokens = [choices[0][0] for choices, _ in results]
        return sum(map(len, tokens)) / seconds, tokens

    rows = []
    print("\n| model | legacy tok/s | backend tok/s | ratio | same tokens |")
    print("|---|---:|---:|---:|---|")
    for preset in ("tiny", "25m"):
        model = str(default_model_dir(spec=PRESETS[preset]))
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(5, 500, (32,), generator=g).tolist() for _ in range(64)]
        best = {"legacy": 0.0, "backend": 0.0}
        outputs = {}
        for _ in range(repeats):
            for name, backend in (("legacy", LegacyBackend()), ("backend", TorchAttentionBackend())):
                rate, outputs[name] = asyncio.run(run(model, backend, prompts))
                best[name] = max(best[name], rate)
        same = outputs["legacy"] == outputs["backend"]
        ratio = best["backend"] / best["legacy"]
        rows.append(
            {
                "model": preset,
                "legacy_tok_s": best["legacy"],
                "backend_tok_s": best["backend"],
                "ratio": ratio,
                "same_tokens": same,
            }
        )
        print(f"| {preset} | {best['legacy']:.0f} | {best['backend']:.0f} | **{ratio:.2f}x** | {same} |")
        if not same:
            raise SystemExit("the two backends produced different tokens")
    return rows


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None)
    parser.add_argument("--engine", action="store_true", help="also the end-to-end engine runs")
    parser.add_argument("--engine-repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backend = TorchAttentionBackend()
    rows = []
    print(f"torch {torch.__version__}, {args.threads} thread(s), float32, block size {BLOCK_SIZE}")
    print("| shape | per_seq ms | one_batch ms | backend ms | speedup vs best old |")
    print("|---|---:|---:|---:|---:|")
    for name, n, max_ctx, kv_heads, heads, d in SHAPES:
        q, k_pool, v_pool, ctx, tables, metadata = make_step(n, max_ctx, kv_heads, heads, d)
        scale = d**-0.5
        a = per_seq(q, k_pool, v_pool, ctx, tables, scale)
        b = one_batch(q, k_pool, v_pool, ctx, tables, scale)
        c = backend.forward(q, k_pool, v_pool, metadata(), scale, None)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-5)
        step = (q, k_pool, v_pool, ctx, tables, scale)
        t_seq = timed(functools.partial(per_seq, *step), args.repeats)
        t_batch = timed(functools.partial(one_batch, *step), args.repeats)
        t_backend = timed(
            lambda step=step, metadata=metadata: backend.forward(*step[:3], metadata(), step[5], None), args.repeats
        )
        speedup = min(t_seq, t_batch) / t_backend
        rows.append(
            {
                "shape": name,
                "per_seq_ms": t_seq,
                "one_batch_ms": t_batch,
                "backend_ms": t_backend,
                "speedup_vs_best_old": speedup,
            }
        )
        print(f"| {name} | {t_seq:.2f} | {t_batch:.2f} | {t_backend:.2f} | **{speedup:.2f}x** |")
    engine = engine_runs(args.engine_repeats) if args.engine else []
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "threads": args.threads,
                    "rows": rows,
                    "engine": engine,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
