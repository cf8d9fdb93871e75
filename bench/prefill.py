"""A long prefill on one stage, against the machine's GEMM rate and llama.cpp, in one run.

Times a prompt of --tokens random ids (default 2,048) computed by `StageRunner.execute` in
chunks of --chunk tokens (default 2,048: one step, as `--max-num-batched-tokens 2048` plans
it), median of --repeats, at one thread; the model's matrix-product FLOPs (2 x parameters of
the decoder's linears x tokens, LM head for the last token only) over that time is the
prefill's rate. In the same run it measures the GEMM rate of this CPU for the paths the
stage could take on the model's own shapes (float32; bfloat16, which is emulated without BF16
units), and, when the llama.cpp anchor is installed (shared/anchors/llama-cpp.md), llama.cpp's
prompt evaluation of the same ids on the same GGUF at one thread.

    python -m bench.prefill [--model GGUF_OR_DIR] [--tokens 2048] [--chunk 2048]

Emulate an AVX2-only CPU on a wider one with the caps of worker_svc/kernels/cpu_features.py:

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        PAGODA_CPU_ISA=avx2 python -m bench.prefill
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

LLAMA_PYTHON = Path.home() / ".cache" / "pagoda-anchor" / "llama" / "venv" / "bin" / "python"
_LLAMA_PROMPT_EVAL = """
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["model"], n_ctx=cfg["n_ctx"], n_batch=cfg["n_batch"], n_ubatch=cfg["n_batch"],
            n_threads=1, n_threads_batch=1, verbose=False)
times = []
for _ in range(cfg["repeats"] + 1):
    llm.reset()
    t = time.perf_counter(); llm.eval(cfg["ids"]); times.append(time.perf_counter() - t)
print(json.dumps({"seconds": sorted(times[1:])[len(times[1:]) // 2]}))
"""


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def gemm_rates(shapes: list[tuple[int, int]], rows: int, repeats: int = 3) -> dict[str, float]:
    """GFLOP/s of torch's float32 and bfloat16 GEMMs over the model's (out, in) shapes at `rows`."""
    import torch
    import torch.nn.functional as F

    out = {}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        total_s, flops = 0.0, 0
        for n, k in shapes:
            x, w = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
            F.linear(x, w)
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                F.linear(x, w)
                times.append(time.perf_counter() - t)
            total_s += _median(times)
            flops += 2 * rows * n * k
        out[name] = flops / total_s / 1e9
    return out


def stage_prefill(folder: str, ids: list[int], chunk: int, repeats: int) -> tuple[float, list[tuple[int, int]]]:
    """Median seconds of the prompt's prefill on one stage, and the decoder's linear shapes."""
    from torch import nn

    from services.sampling import SamplingParams
    from services.step import CachedSeq, NewSeq, StepPlan
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.runner import StageRunner
    from worker_svc.weights.packed import PackedLinear

    model = load_stage(folder, 0, 1, dtype="auto")
    block = 16
    num_blocks = -(-len(ids) // block) + 1
    runner = StageRunner(model, num_blocks, block, "cpu")
    first = f"layers.{model.start}."  # one decoder layer's products (fused ones counted once, as parts)
    shapes = [
        (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, PackedLinear | nn.Linear)
        and first in name
        and not name.endswith(("qkv", "gate_up", "qkv_packed", "gate_up_packed"))
    ]

    greedy, times, step, seq_id = SamplingParams(temperature=0.0), [], 0, 0
    for _ in range(repeats + 1):
        seq_id += 1
        began = time.perf_counter()
        done = 0
        while done < len(ids):
            n = min(chunk, len(ids) - done)
            step += 1
            finished = (seq_id - 1,) if done == 0 and seq_id > 1 else ()
            if done == 0:
                plan = StepPlan(
                    step,
                    (NewSeq(seq_id, tuple(ids), len(ids), 0, n, tuple(range(num_blocks)), greedy),),
                    finished_seq_ids=finished,
                )
            else:
                plan = StepPlan(step, (), (CachedSeq(seq_id, n, 0),))
            runner.execute(plan)
            done += n
        times.append(time.perf_counter() - began)
    return _median(times[1:]), shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the real model's GGUF (SmolLM2-135M Q4_1)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    from bench.machine import cpu_record
    from wiring.model_source import default_model, prepare_gguf
    from worker_svc.kernels.calibrate import cpu_paths

    torch.set_num_threads(1)
    path = args.model or str(default_model(log=lambda line: None))
    folder = str(prepare_gguf(path) if str(path).endswith(".gguf") else path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 30000, (args.tokens,), generator=g).tolist()
    seconds, shapes = stage_prefill(folder, ids, args.chunk, args.repeats)
    params = sum(n * k for n, k in shapes) * json.loads(Path(folder, "config.json").read_text())["num_hidden_layers"]
    rate = 2 * params * args.tokens / seconds / 1e9
    gemm = gemm_rates(shapes, min(args.chunk, 512))
    llama = None
    if LLAMA_PYTHON.exists() and str(path).endswith(".gguf"):
        cfg = {
            "model": str(path),
            "ids": ids,
            "n_ctx": args.tokens + 16,
            "n_batch": min(args.chunk, 2048),
            "repeats": args.repeats,
        }
        from bench.vs_llama_cpp_anchor import llama_script

        done = subprocess.run(
            [str(LLAMA_PYTHON), "-c", llama_script(_LLAMA_PROMPT_EVAL), json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        llama = json.loads(done.stdout.strip().splitlines()[-1])["seconds"] if done.returncode == 0 else None
    cpu, paths = cpu_record(), cpu_paths()
    chosen = "bf16" if paths.packed_prefill == "bf16-gemm" else "f32"  # the GEMM the stage's prefill takes
    report = {
        "cpu": cpu,
        "paths": paths.describe(),
        "model": str(path),
        "tokens": args.tokens,
        "chunk": args.chunk,
        "seconds": seconds,
        "tok_s": args.tokens / seconds,
        "gflop_s": rate,
        "gemm_gflop_s": gemm,
        "chosen_gemm": chosen,
        "share_of_chosen_gemm": rate / gemm[chosen],
        "llama_cpp_seconds": llama,
        "vs_llama_cpp": (llama / seconds) if llama else None,
    }
    print(f"CPU: {cpu['describe']}\npaths: {report['paths']}")
    print(
        f"prefill {args.tokens} tokens (chunks of {args.chunk}): {seconds:.2f} s, {args.tokens / seconds:.0f} tok/s, "
        f"{rate:.1f} GFLOP/s = {rate / gemm[chosen]:.2f} of the {chosen} GEMM on the model's shapes "
        f"(float32 {gemm['f32']:.1f} GFLOP/s, bfloat16 {gemm['bf16']:.1f})"
    )
    if llama:
        print(f"llama.cpp prompt eval (1 thread, same file): {llama:.2f} s -> Pagoda {llama / seconds:.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
