"""Benchmark: a decode step of a whole real model at batch B against torch's bfloat16 GEMM
rate on the same products, in one run (issue 24: "batch-64 decode at >= 50% of the bfloat16
GEMM rate the bench measures for the same shapes with torch in the same run").

    .venv/bin/python -m bench.batch_decode --model ~/.cache/pagoda/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --model ~/.cache/pagoda-anchor/smol135 --batches 1,16,64 [--context 128] [--threads 1]

Each model (a checkpoint folder or a GGUF file, served at `--dtype` auto: a GGUF's packed
types, a float32 folder as bfloat16 weights on AVX-512 BF16 CPUs) runs as one stage
(`StageRunner`, the native CPU backend): a prefill of B random prompts of `--context`
tokens, then the median of `--steps` decode steps of all B rows. The baseline is torch's
`F.linear` in bfloat16 on the step's products ([B, K] x [N, K] for every linear layer of
every layer, and the LM head), each timed alone, summed: the step's GEMM time if every
product ran at torch's bfloat16 rate with nothing around it. Printed per model and batch:
ms per step, the step's product GFLOP/s, torch's, and their ratio (above 0.5: the target
met). Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _timed(fn, min_s: float = 0.3) -> float:
    fn()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        fn()
        runs += 1
    return (time.perf_counter() - start) / runs


def product_shapes(model) -> list[tuple[int, int]]:
    """(N, K) of every product a decode row goes through: each layer's linears (fused
    q/k/v and gate/up as the stage holds them), then the LM head."""
    from worker_svc.weights.packed import PackedLinear

    shapes = []
    for layer in model.model.layers.values():
        att, mlp = layer.self_attn, layer.mlp
        parts = [att.qkv_packed or att.q_proj, att.o_proj, mlp.gate_up_packed or mlp.gate_proj, mlp.down_proj]
        if att.qkv_packed is None:
            parts[1:1] = [att.k_proj, att.v_proj]
        if mlp.gate_up_packed is None:
            parts.insert(-1, mlp.up_proj)
        for p in parts:
            if isinstance(p, PackedLinear):
                shapes.append((p.out_features, p.in_features))
            else:
                shapes.append(tuple(p.weight.shape))
    cfg = model.config
    shapes.append((cfg.vocab_size, cfg.hidden_size))
    return shapes


def torch_bf16_s(shapes: list[tuple[int, int]], batch: int) -> float:
    import torch
    import torch.nn.functional as F

    total = 0.0
    for (n, k), count in Counter(shapes).items():
        x = torch.randn(batch, k).bfloat16()
        w = torch.randn(n, k).bfloat16()
        total += count * _timed(lambda x=x, w=w: F.linear(x, w))
    return total


def pagoda_step_s(model, batch: int, context: int, steps: int) -> float:
    import torch

    from services.defaults import BLOCK_SIZE as block_size
    from services.sampling import SamplingParams
    from services.step import CachedSeq, NewSeq, StepPlan
    from worker_svc.execution.runner import StageRunner

    per_seq = -(-(context + steps + 8) // block_size)
    runner = StageRunner(model, batch * per_seq, block_size, "cpu")
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(5, model.config.vocab_size - 1, (batch, context), generator=g)
    for first in range(0, batch, 16):  # prefill in chunks of 16 sequences
        runner.execute(
            StepPlan(
                1 + first,
                new_seqs=tuple(
                    NewSeq(
                        i,
                        tuple(prompts[i].tolist()),
                        context,
                        0,
                        context,
                        tuple(range(i * per_seq, (i + 1) * per_seq)),
                        greedy,
                    )
                    for i in range(first, min(batch, first + 16))
                ),
            )
        )
    decode = tuple(CachedSeq(i, 1, per_seq) for i in range(batch))
    times = []
    for k in range(steps + 3):
        start = time.perf_counter()
        runner.execute(StepPlan(1000 + k, cached_seqs=decode))
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="a checkpoint folder or .gguf (repeatable)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    from wiring.model_source import prepare_gguf
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.kernels.cpu_kernels import keep_freed_memory

    torch.set_num_threads(args.threads)
    keep_freed_memory()
    rows = []
    for path in args.model:
        path = os.path.expanduser(path)
        folder = prepare_gguf(path) if path.endswith(".gguf") else path
        model = load_stage(str(folder))
        shapes = product_shapes(model)
        for batch in (int(b) for b in args.batches.split(",")):
            flops = 2 * batch * sum(n * k for n, k in shapes)
            step = pagoda_step_s(model, batch, args.context, args.steps)
            gemm = torch_bf16_s(shapes, batch)
            row = {
                "model": Path(path).name,
                "format": model.weight_format or str(next(model.parameters()).dtype),
                "batch": batch,
                "context": args.context,
                "threads": args.threads,
                "step_ms": round(step * 1000, 2),
                "step_gflops": round(flops / step / 1e9, 1),
                "torch_bf16_gemm_ms": round(gemm * 1000, 2),
                "torch_bf16_gflops": round(flops / gemm / 1e9, 1),
                "share_of_bf16_gemm_rate": round(gemm / step, 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| model | format | batch | step ms | step GFLOP/s | torch bf16 GEMM ms | GFLOP/s | share |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['format']} | {r['batch']} | {r['step_ms']:.1f} | {r['step_gflops']:.0f} | "
            f"{r['torch_bf16_gemm_ms']:.1f} | {r['torch_bf16_gflops']:.0f} | {r['share_of_bf16_gemm_rate']:.2f} |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
