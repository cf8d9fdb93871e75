"""Benchmark: one decode step of a whole model, Pagoda's stage against `transformers`.

    .venv/bin/python -m bench.decode_step --batches 1,16,64 [--context 200] \
        [--model 25m] [--out /tmp/bench_decode_step.json]

Same checkpoint (a `pagoda tiny-model` preset, made once under `$PAGODA_CACHE_DIR` or
`~/.cache/pagoda`), float32, one torch thread, the same prompts: `transformers`' forward of
one token per sequence over its contiguous `DynamicCache` (after a prefill of `--context`
tokens), against `StageRunner.execute` of the whole model as one stage, its KV in the paged
pool, with each attention backend (`cpu`: the native decode kernel; `torch`: the
reference). Both sample greedily (argmax). Median of `--steps` steps after 4 warm-up steps,
all in this run; prints ms per step and transformers' time / Pagoda's (above 1: Pagoda
faster). Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def model_dir(preset: str) -> Path:
    from services.settings import cache_root
    from wiring.tiny_model import PRESETS, make_tiny_model

    path = cache_root() / "bench-models" / preset
    if not (path / "config.json").exists():
        make_tiny_model(path, PRESETS[preset], overwrite=True)
    return path


def transformers_ms(path: Path, prompts, steps: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    times = []
    with torch.inference_mode():
        out = hf(prompts, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps + 4):
            start = time.perf_counter()
            out = hf(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return statistics.median(times[4:]) * 1000


def pagoda_ms(path: Path, prompts, steps: int, backend: str) -> float:
    from services.sampling import SamplingParams
    from services.step import CachedSeq, NewSeq, StepPlan
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.runner import StageRunner

    batch, context = prompts.shape
    from services.defaults import BLOCK_SIZE as block_size

    per_seq = -(-(context + steps + 4) // block_size)
    runner = StageRunner(load_stage(str(path)), batch * per_seq, block_size, backend)
    greedy = SamplingParams(temperature=0.0)
    runner.execute(
        StepPlan(
            1,
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
                for i in range(batch)
            ),
        )
    )
    decode = tuple(CachedSeq(i, 1, per_seq) for i in range(batch))
    times = []
    for k in range(steps + 4):
        start = time.perf_counter()
        runner.execute(StepPlan(2 + k, cached_seqs=decode))
        times.append(time.perf_counter() - start)
    return statistics.median(times[4:]) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="25m", help="tiny-model preset (default 25m)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    from worker_svc.kernels.cpu_kernels import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()
    path = model_dir(args.model)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(5, 1000, (batch, args.context), generator=torch.Generator().manual_seed(batch))
        hf = transformers_ms(path, prompts, args.steps)
        row = {"model": args.model, "batch": batch, "context": args.context, "transformers_ms": round(hf, 2)}
        for backend in ("cpu", "torch"):
            ms = pagoda_ms(path, prompts, args.steps, backend)
            row[f"pagoda_{backend}_ms"] = round(ms, 2)
            row[f"speedup_{backend}"] = round(hf / ms, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        "\n| model | batch | context | transformers ms/step | Pagoda `cpu` ms/step | x | Pagoda `torch` ms/step | x |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['batch']} | {r['context']} | {r['transformers_ms']:.2f} | "
            f"{r['pagoda_cpu_ms']:.2f} | {r['speedup_cpu']:.2f}x | {r['pagoda_torch_ms']:.2f} | "
            f"{r['speedup_torch']:.2f}x |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
