"""Micro-benchmark: the native quantized / bfloat16 matmul kernels against torch's F.linear.

    .venv/bin/python -m bench.quant_matmul --threads 1 --tokens 1,16,64,128 \
        [--formats Q8_0,Q4_0,Q4_1,bf16,bf16dot,torch-f32,torch-bf16] [--isa avx2] [--act-bits 8,16] \
        [--json out.json]

Shapes are SmolLM2-135M's projections (K=576: qkv N=960, o N=576, gate_up N=3072, lm_head
N=49152; K=1536: down N=576). For each shape, token count T and format it prints the median
time of one call, the weight bytes streamed per second (GB/s: the matrix's bytes / time) and
GFLOP/s (2 T N K / time). "hot" rows reuse one weight matrix (it stays in the caches when it
fits); "cold" rows (T = 1 only) cycle through enough copies of it (>= --cold-mib) that every
call reads its weights from memory, as a decode step over a whole model does. The memory
bandwidth line (one thread reading a large tensor: `sum`, and copying one) is the bound a
decode step can reach.

Formats: Q8_0 / Q4_0 / Q4_1 (worker_svc.kernels.quant_kernels matmul), bf16 (matmul_bf16: weights
widened to float32, FMA), bf16dot (AVX-512 BF16 vdpbf16ps on x rounded to bfloat16),
torch-f32 (F.linear, float32 weights), torch-bf16 (F.linear with x and w bfloat16). The
block formats run once per activation precision of --act-bits (int8: llama.cpp's products;
int16: the default), printed side by side: us / GB/s / GFLOP/s of int8, then of int16 and
the time ratio int16 / int8 (the JSON has one row per precision, "act_bits" set).
K-quant rows (`--kquant Q4_K:512x768,Q6_K:49152x768`, N x K) time the super-block kernels on
random blocks (finite fp16 scales) at --tokens, cold weights, both precisions on each of
--isas; `--baseline PATH` times another build of the library (an older commit's .so) in turns
with this one, so that a shared machine's load falls on both alike, and prints new / old.
This is a benchmark, not a test: it asserts nothing about the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_svc.kernels import block_formats  # noqa: E402
from worker_svc.kernels import quant_kernels as qk  # noqa: E402

SHAPES = {  # name -> (N, K)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "bf16", "bf16dot", "torch-f32", "torch-bf16")


def median_s(fn: Callable[[int], object], min_time_s: float, max_reps: int) -> float:
    """Median wall time of fn(i) over repetitions (after two warm-up calls)."""
    fn(0)
    fn(1)
    times: list[float] = []
    start = time.perf_counter()
    i = 0
    while len(times) < 5 or (time.perf_counter() - start < min_time_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        i += 1
    return statistics.median(times)


def memory_bandwidth(min_time_s: float) -> dict[str, float]:
    """GB/s of one thread streaming a 512 MiB tensor: read (sum) and copy (read + write)."""
    a = torch.ones(128 << 20)
    b = torch.empty_like(a)
    n_bytes = a.numel() * 4
    read = median_s(lambda i: a.sum(), min_time_s, 20)
    copy = median_s(lambda i: b.copy_(a), min_time_s, 20)
    return {"read_GBps": n_bytes / read / 1e9, "copy_GBps": 2 * n_bytes / copy / 1e9}


def weights(fmt: str, N: int, K: int) -> tuple[torch.Tensor, int]:
    """A weight matrix of the format and its size in bytes."""
    w = torch.randn(N, K) * 0.05
    if fmt in block_formats.BLOCK_TYPES:
        import gguf

        wq = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, fmt))
        t = torch.from_numpy(wq)
        return t, t.numel()
    if fmt == "torch-f32":
        return w, w.numel() * 4
    return w.to(torch.bfloat16), w.numel() * 2


def call(
    kernels: qk.QuantKernels, dot: qk.QuantKernels | None, fmt: str, isa: str | None, act_bits: int | None
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]:
    if fmt in block_formats.BLOCK_TYPES:
        return lambda x, w, out: kernels.matmul(x, w, fmt, out=out, isa=isa, act_bits=act_bits)
    if fmt == "bf16":
        return lambda x, w, out: kernels.matmul_bf16(x, w, out=out, isa=isa)
    if fmt == "bf16dot":
        assert dot is not None
        return lambda x, w, out: dot.matmul_bf16(x, w, out=out)
    if fmt == "torch-f32":
        return lambda x, w, out: F.linear(x, w)
    return lambda x, w, out: F.linear(x.to(torch.bfloat16), w)


def run(args: argparse.Namespace) -> list[dict]:
    kernels = qk.quant_kernels()
    if kernels is None:
        raise SystemExit("native kernels unavailable (see the log)")
    dot = qk.QuantKernels(kernels.path, bf16_dot=True) if kernels.has_bf16_dot else None
    formats = [f for f in args.formats.split(",") if f != "bf16dot" or dot is not None]
    act_bits = [int(b) for b in args.act_bits.split(",")]
    rows: list[dict] = []
    head = f"{'us':>9} {'GB/s':>6} {'GFLOP/s':>7}"
    print(
        f"{'shape':8} {'N':>6} {'K':>5} {'T':>4} {'weights':7} {'format':10} "
        + " | ".join(f"{'int' + str(b) + ' ' if len(act_bits) > 1 else '':5}{head}" for b in act_bits)
        + (f" | {'i16/i8':>6}" if act_bits == [8, 16] else "")
    )
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        for fmt in formats:
            w, n_bytes = weights(fmt, N, K)
            copies = [w] + [w.clone() for _ in range(max(0, math.ceil(args.cold_mib * 2**20 / n_bytes) - 1))]
            precisions = act_bits if fmt in block_formats.BLOCK_TYPES else [None]
            for T in [int(t) for t in args.tokens.split(",")]:
                x = torch.randn(T, K)
                out = torch.empty(T, N)
                for temp in ("hot", "cold") if T == 1 else ("hot",):
                    ws = copies if temp == "cold" else [w]
                    cells = []
                    for bits in precisions:
                        fn = call(kernels, dot, fmt, args.isa, bits)
                        s = median_s(
                            lambda i, fn=fn, x=x, ws=ws, out=out: fn(x, ws[i % len(ws)], out),
                            args.min_time,
                            args.max_reps,
                        )
                        row = {
                            "shape": name,
                            "N": N,
                            "K": K,
                            "T": T,
                            "weights": temp,
                            "format": fmt,
                            "act_bits": bits,
                            "us": s * 1e6,
                            "GBps": n_bytes / s / 1e9,
                            "GFLOPps": 2 * T * N * K / s / 1e9,
                        }
                        rows.append(row)
                        cells.append(row)
                    text = " | ".join(f"{'':5}{c['us']:9.1f} {c['GBps']:6.1f} {c['GFLOPps']:7.1f}" for c in cells)
                    if len(cells) == 2:
                        text += f" | {cells[1]['us'] / cells[0]['us']:6.2f}"
                    print(f"{name:8} {N:6} {K:5} {T:4} {temp:7} {fmt:10} {text}", flush=True)
            del copies
    return rows


def kquant_blocks(qtype: str, N: int, K: int) -> torch.Tensor:
    """Random K-quant blocks uint8 [N, row_bytes] with finite fp16 d (and dmin)."""
    from worker_svc.kernels.kquants import KQUANT_TYPES

    _, block, size = KQUANT_TYPES[qtype]
    raw = torch.randint(0, 256, (N * K // block, size), dtype=torch.uint8)
    for at in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}[qtype]:
        raw[:, at : at + 2] = (torch.randn(raw.shape[0]) * 0.01).to(torch.float16).view(-1, 1).view(torch.uint8)
    return raw.view(N, -1).contiguous()


def time_libraries(
    libs: dict[str, qk.QuantKernels], product: Callable[[qk.QuantKernels, int], object], args: argparse.Namespace
) -> dict[str, float]:
    """The fastest of --rounds medians of product(lib, i) per library, the libraries in turns."""
    times: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(args.rounds):
        for name, lib in libs.items():
            times[name].append(median_s(lambda i, lib=lib: product(lib, i), args.min_time / args.rounds, 200))
    return {name: min(ts) for name, ts in times.items()}


def run_kquant(args: argparse.Namespace) -> list[dict]:
    libs = {"new": qk.quant_kernels()}
    if args.baseline is not None:
        libs["old"] = qk.QuantKernels(str(args.baseline))
    rows: list[dict] = []
    for spec in args.kquant.split(","):
        qtype, shape = spec.split(":")
        N, K = (int(v) for v in shape.split("x"))
        w = kquant_blocks(qtype, N, K)
        copies = [w] + [w.clone() for _ in range(max(0, math.ceil(args.cold_mib * 2**20 / w.numel()) - 1))]
        for isa in args.isas.split(","):
            for T in [int(t) for t in args.tokens.split(",")]:
                x, out = torch.randn(T, K), torch.empty(T, N)
                for bits in [int(b) for b in args.act_bits.split(",")]:

                    def product(
                        lib: qk.QuantKernels, i: int, x=x, out=out, isa=isa, bits=bits, qtype=qtype, copies=copies
                    ) -> object:
                        return lib.matmul(x, copies[i % len(copies)], qtype, out=out, isa=isa, act_bits=bits)

                    best = time_libraries(libs, product, args)
                    row = {"format": qtype, "N": N, "K": K, "T": T, "isa": isa, "act_bits": bits}
                    for name, s in best.items():
                        row[f"{name}_us"], row[f"{name}_GBps"] = s * 1e6, w.numel() / s / 1e9
                    rows.append(row)
                    text = " | ".join(
                        f"{name} {row[name + '_us']:8.1f} us {row[name + '_GBps']:5.1f} GB/s" for name in libs
                    )
                    ratio = f" | new/old {row['new_us'] / row['old_us']:.2f}" if "old" in libs else ""
                    print(f"{qtype:5} {N:6}x{K:<5} T={T:<3} {isa:7} int{bits:<2} {text}{ratio}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", default="1,16,64,128")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--isa", default=None, help="avx512, avx2 or scalar (default: the best / PAGODA_CPU_ISA)")
    p.add_argument("--act-bits", default="8,16", help="activation precisions of the block formats: 8, 16 or 8,16")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds of repetitions per row")
    p.add_argument("--max-reps", type=int, default=500)
    p.add_argument("--cold-mib", type=float, default=192.0, help="weight bytes cycled through in cold rows")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--kquant", default=None, help="K-quant products to time instead: TYPE:NxK,...")
    p.add_argument("--isas", default="avx512,avx2", help="ISA paths of --kquant")
    p.add_argument("--baseline", type=Path, default=None, help="another build of the library to time beside")
    p.add_argument("--rounds", type=int, default=3, help="turns of the libraries per --kquant row")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bw = memory_bandwidth(args.min_time)
    kernels = qk.quant_kernels()
    print(
        f"{platform.processor() or platform.machine()}, {args.threads} thread(s), torch {torch.__version__}, "
        f"isa {args.isa or (kernels.isa if kernels else None)} of {qk.available_isas()}"
    )
    print(f"memory bandwidth (1 thread): read {bw['read_GBps']:.1f} GB/s, copy {bw['copy_GBps']:.1f} GB/s")
    rows = run_kquant(args) if args.kquant else run(args)
    if args.json is not None:
        args.json.write_text(json.dumps({"bandwidth": bw, "threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
