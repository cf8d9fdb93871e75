"""Pagoda against llama.cpp: single-stream decode on the same GGUF file, one thread each.

For each GGUF file (`--gguf`, default Pagoda's default model, SmolLM2-135M-Instruct Q4_1, and
its Q8_0 export when present), one after another, in one run:

    llama.cpp   llama-cpp-python from its own virtualenv (shared/anchors/llama-cpp.md), as a
                subprocess printing JSON: `Llama(n_threads=1, n_threads_batch=1)`, per repeat
                `reset(); eval(prompt)` (prefill: 64 random token ids), then 128 greedy tokens
                token by token (`sample(temp=0.0)`, `eval([tok])`, EOS ignored): prefill tok/s =
                prompt / eval time, decode tok/s = 127 / time of the 127 steps after the first
                token; 1 warm-up, median of 3 (`--repeats`)
    pagoda-serve `pagoda serve FILE.gguf` (its defaults: one stage on one core, the services on
                the other), REST, streamed, the same prompt ids -> 128 tokens with `ignore_eos`:
                decode tok/s = (tokens - 1) / (last chunk - first chunk), TTFT; same repeats
    pagoda-inproc the in-process engine (`wiring.local_engine`, as `LLM(path)` builds it) at one
                torch thread, in a subprocess: the same prompt ids -> 128 tokens; decode tok/s
                from the arrival times of the token outputs, as for the server
    16 streams  (`--streams 16`, 0: skip) 16 streamed requests at once, a text prompt each (64
                random ids decoded), 128 tokens: aggregate output tok/s, against both Pagoda's
                server and llama-cpp-python's server (`python -m llama_cpp.server --n_threads 1
                --n_threads_batch 1 --n_ctx 4096`, when its `[server]` extra is installed; it
                has no parallel decoding: one Llama object behind a lock serves the requests
                one at a time; `--interrupt_requests False`, else each new request cuts the one streaming).
                llama.cpp's server has no `ignore_eos`: `min_tokens` = max_tokens

Also, at the start and end of the run, the memory bandwidth of one core (a 1-thread torch sum
over a 512 MiB float32 tensor, best of 7), and each decode figure as a share of the bound that
bandwidth sets on batch-1 decode: tok/s x weight bytes per token (the file's tensor bytes, as
llama.cpp reports them) / bandwidth.

Run:

    .venv/bin/python -m bench.vs_llama_cpp
    .venv/bin/python -m bench.vs_llama_cpp --gguf A.gguf,B.gguf --streams 0 --repeats 1

Figures of one run compare; across runs the shared machine drifts. Writes JSON to `--out`.
llama.cpp's own commands (the single-stream script, its server) are in bench/vs_llama_cpp_anchor.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.clients import sse_chunks
from bench.machine import cpu_record, measure_bandwidth, run_json
from bench.server_process import REPO_ROOT, Server, ServerRun, run_on_server
from bench.vs_llama_cpp_anchor import health_wait_llama, llama_has_server, llama_server, run_llama
from bench.vs_vllm import git_state
from bench.vs_vllm_arms import DEFAULT_ANCHOR, ArmSpec, Paths, make_server
from bench.vs_vllm_load import Client, LoadSpec

DEFAULT_Q4_1 = Path.home() / ".cache" / "pagoda" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_Q8_0 = DEFAULT_ANCHOR / "smol135.Q8_0.gguf"
SERVED = "tiny"


INPROC_SCRIPT = r"""
import asyncio, json, statistics, sys, time, uuid
import torch
torch.set_num_threads(1)
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.request import Request, SamplingOptions
from wiring.local_engine import build_local_engine
from wiring.model_source import is_gguf, prepare_gguf
cfg = json.loads(sys.argv[1])
model = cfg["model"]
if is_gguf(model):
    model = str(prepare_gguf(model))

async def main():
    t0 = time.perf_counter()
    config = SchedulerConfig(model=model, num_kv_blocks=256, async_scheduling=False)
    engine = build_local_engine(model, config, 256, "auto", "cpu")
    await engine.start()
    load_s = time.perf_counter() - t0
    runs = []
    try:
        for i, prompt in enumerate(cfg["prompts"]):
            opts = SamplingOptions(max_tokens=cfg["n_out"], temperature=0.0, ignore_eos=True)
            req = Request(f"bench-{i}-{uuid.uuid4().hex[:8]}", tuple(prompt), opts, arrival_s=0.0)
            arrivals, ids = [], []
            t0 = time.perf_counter()
            async for out in engine.submit(req):
                now = time.perf_counter()
                for d in out.deltas:
                    for tok in d.token_ids:
                        arrivals.append(now)
                        ids.append(tok)
                if getattr(out, "error", None) is not None:
                    raise RuntimeError(str(out.error))
            n = len(ids)
            span = arrivals[-1] - arrivals[0] if n > 1 else None
            runs.append({"warmup": i == 0, "tokens": n, "ttft_s": arrivals[0] - t0 if n else None,
                         "e2e_s": time.perf_counter() - t0,
                         "decode_tok_s": (n - 1) / span if span else None,
                         "distinct_arrivals": len(set(arrivals)), "head": ids[:8]})
    finally:
        await engine.stop()
    meas = [r for r in runs if not r["warmup"]]
    dec = [r["decode_tok_s"] for r in meas if r["decode_tok_s"]]
    print(json.dumps({"load_s": load_s, "runs": runs,
                      "decode_tok_s": statistics.median(dec) if dec else None,
                      "ttft_s": statistics.median(r["ttft_s"] for r in meas)}))

asyncio.run(main())
"""


def prompts_for(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(length)] for _ in range(count)]


def run_inproc(model: Path, prompts: list[list[int]], n_out: int) -> dict[str, Any]:
    cfg = json.dumps({"model": str(model), "prompts": prompts, "n_out": n_out})
    return run_json([sys.executable, "-c", INPROC_SCRIPT, cfg], 900)


async def pagoda_single(base_url: str, prompts: list[list[int]], n_out: int) -> dict[str, Any]:
    spec = LoadSpec(num_requests=4, prompt_len=len(prompts[0]), max_tokens=n_out, request_timeout_s=300.0)
    client = Client(base_url, spec)
    runs = []
    try:
        for i, p in enumerate(prompts):
            r = await client.complete_streamed(p, n_out)
            runs.append(
                {
                    "warmup": i == 0,
                    "tokens": r.completion_tokens,
                    "ttft_s": r.ttft_s,
                    "e2e_s": r.e2e_s,
                    "finish_reason": r.finish_reason,
                    "decode_tok_s": 1.0 / r.itl_s if r.itl_s else None,
                }
            )
    finally:
        await client.close()
    meas = [r for r in runs if not r["warmup"]]
    dec = [r["decode_tok_s"] for r in meas if r["decode_tok_s"]]
    bad = [r["tokens"] for r in runs if r["tokens"] != n_out]
    return {
        "runs": runs,
        "decode_tok_s": statistics.median(dec) if dec else None,
        "ttft_s": statistics.median(r["ttft_s"] for r in meas if r["ttft_s"] is not None),
        "length_mismatches": bad,
    }


async def concurrent_streams(
    url: str, body_for: Any, texts: list[str], n_out: int, timeout_s: float = 900.0
) -> dict[str, Any]:
    """All `texts` streamed at once; each reply's chunk arrival times and token count."""
    import httpx2

    n = len(texts) + 2
    async with httpx2.AsyncClient(
        timeout=httpx2.Timeout(timeout_s), limits=httpx2.Limits(max_connections=n, max_keepalive_connections=n)
    ) as http:

        async def one(text: str) -> dict[str, Any]:
            t0 = time.perf_counter()
            arrivals: list[float] = []
            usage_tokens = 0
            finish = None
            async for now, chunk in sse_chunks(http, url, body_for(text)):
                for choice in chunk.get("choices") or ():
                    if choice.get("text") or not choice.get("finish_reason"):
                        arrivals.append(now)
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    usage_tokens = int(chunk["usage"].get("completion_tokens", 0))
            tokens = usage_tokens or len(arrivals)
            span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else None
            return {
                "tokens": tokens,
                "chunks": len(arrivals),
                "finish_reason": finish,
                "ttft_s": arrivals[0] - t0 if arrivals else None,
                "e2e_s": time.perf_counter() - t0,
                "decode_tok_s": (tokens - 1) / span if span else None,
            }

        t0 = time.perf_counter()
        replies = await asyncio.gather(*(one(t) for t in texts))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in replies)
    dec = [r["decode_tok_s"] for r in replies if r["decode_tok_s"]]
    return {
        "streams": len(texts),
        "wall_s": wall,
        "tokens": tokens,
        "aggregate_tok_s": tokens / wall,
        "median_stream_decode_tok_s": statistics.median(dec) if dec else None,
        "median_ttft_s": statistics.median(r["ttft_s"] for r in replies if r["ttft_s"]),
        "length_mismatches": [r["tokens"] for r in replies if r["tokens"] != n_out],
        "replies": replies,
    }


def stream_texts(folder: Path, count: int, length: int, seed: int) -> list[str]:
    """Text prompts: `length` random ids decoded with the model's tokenizer (re-tokenized
    by each server, so a prompt's length may differ by a few tokens from `length`)."""
    from services.text import Tokenizer

    tok = Tokenizer(str(folder))
    return [tok.decode(ids) for ids in prompts_for(seed, count, length)]


def with_server(
    server: Server, work: Callable[[str], Any], wait_healthy: Callable[[float], float] | None = None
) -> ServerRun:
    """`run_on_server` with this benchmark's 300 s to start and its progress lines."""
    print(f"  starting {server.name}: {shlex.join(server.cmd)}", flush=True)
    return run_on_server(server, 300, work, wait_healthy=wait_healthy, error_chars=500, alive_note="stopped; ALIVE")


def share(tok_s: float | None, weight_bytes: int | None, bw_gb_s: float | None) -> float | None:
    """Measured decode tok/s over the bandwidth bound (bw / weight bytes per token)."""
    if not tok_s or not weight_bytes or not bw_gb_s:
        return None
    return tok_s * weight_bytes / (bw_gb_s * 1e9)


def _f(v: float | None, digits: int = 1, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}"


def table(files: list[dict[str, Any]], bw: float | None) -> str:
    head = (
        "file",
        "arm",
        "decode tok/s",
        "prefill tok/s",
        "TTFT ms",
        "ms/token",
        "/llama.cpp",
        "bw share",
        "16-stream tok/s",
    )
    rows = [head]
    for f in files:
        ref = (f.get("llama") or {}).get("decode_tok_s")
        for arm in ("llama", "pagoda_serve", "pagoda_inproc"):
            r = f.get(arm) or {}
            dec = r.get("decode_tok_s")
            streams = f.get(f"{arm}_streams") or {}
            rows.append(
                (
                    f["name"],
                    {"llama": "llama.cpp", "pagoda_serve": "pagoda-serve", "pagoda_inproc": "pagoda-inproc"}[arm],
                    _f(dec),
                    _f(r.get("prefill_tok_s")),
                    _f(r.get("ttft_s"), 1, 1e3),
                    _f(1 / dec if dec else None, 2, 1e3),
                    _f(dec / ref if dec and ref else None, 2),
                    _f(share(dec, f.get("weight_bytes"), bw), 2),
                    _f(streams.get("aggregate_tok_s")),
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        f"single stream, 64 random prompt ids -> 128 tokens, one compute thread; "
        f"bw share = tok/s x tensor bytes / one-core bandwidth ({_f(bw, 2)} GB/s)"
    ]
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True)))
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for f in files:
        for k, v in f.get("errors", {}).items():
            lines.append(f"{f['name']} {k}: FAILED: {v.splitlines()[0][:300]}")
        for note in f.get("notes", []):
            lines.append(f"{f['name']}: {note}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.vs_llama_cpp",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--gguf",
        default=None,
        help=f"comma-separated GGUF files (default: {DEFAULT_Q4_1} and, if present, {DEFAULT_Q8_0})",
    )
    p.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=DEFAULT_ANCHOR / "smol135",
        help="a folder with the model's tokenizer, for the text prompts of the 16-stream runs (default: %(default)s)",
    )
    p.add_argument("--llama-python", type=Path, default=DEFAULT_ANCHOR / "llama" / "venv" / "bin" / "python")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="measured runs after 1 warm-up")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams; 0: skip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arms",
        default="llama,pagoda-serve,pagoda-inproc",
        help="comma-separated of llama, pagoda-serve, pagoda-inproc",
    )
    p.add_argument("--pagoda-args", default="", help="extra `pagoda serve` flags")
    p.add_argument("--run-dir", type=Path, default=REPO_ROOT / "bench" / "results" / "tmp" / "vs_llama_cpp")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "vs_llama_cpp.json")
    args = p.parse_args(argv)
    if args.gguf:
        args.files = [Path(x.strip()).expanduser().resolve() for x in args.gguf.split(",") if x.strip()]
    else:
        args.files = [f for f in (DEFAULT_Q4_1, DEFAULT_Q8_0) if f.is_file()]
    for f in args.files:
        if not f.is_file():
            p.error(f"--gguf: no file {f}")
    args.arm_set = {a.strip() for a in args.arms.split(",") if a.strip()}
    return args


@dataclass(frozen=True)
class Load:
    """What every file's arms run: the prompt ids (1 warm-up + the repeats), the text prompts
    of the concurrent streams (none: no such run) and the tokens to generate."""

    prompts: list[list[int]]
    texts: list[str]
    n_out: int


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    t_run = time.perf_counter()
    print("bandwidth (1 thread, 512 MiB float32 sum) ...", flush=True)
    bw_start = measure_bandwidth()
    print(f"  {bw_start['best_gb_s']:.2f} GB/s (best), {bw_start['median_gb_s']:.2f} (median)", flush=True)
    prompts = prompts_for(args.seed, args.repeats + 1, args.prompt_len)
    has_server = args.streams > 0 and llama_has_server(args.llama_python)
    texts = stream_texts(args.tokenizer_dir, args.streams, args.prompt_len, args.seed + 1) if args.streams > 0 else []
    load = Load(prompts, texts, args.max_tokens)
    paths = Paths(DEFAULT_ANCHOR, args.run_dir.resolve(), args.tokenizer_dir)
    files = [run_file(model, args, paths, load, has_server) for model in args.files]
    print("bandwidth again ...", flush=True)
    bw_end = measure_bandwidth()
    bw = max(bw_start["best_gb_s"], bw_end["best_gb_s"])
    for f in files:
        add_ratios(f, bw)
    text = f"CPU: {cpu_record()['describe']}\n" + table(files, bw)
    print()
    print(text)
    report = {
        "started": started,
        "wall_s": time.perf_counter() - t_run,
        "command": [sys.executable, "-m", "bench.vs_llama_cpp", *(argv or sys.argv[1:])],
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "cpu": cpu_record()},
        "pagoda_source": git_state(REPO_ROOT),
        "load": {
            "prompt_len": args.prompt_len,
            "max_tokens": load.n_out,
            "repeats": args.repeats,
            "streams": args.streams,
            "seed": args.seed,
        },
        "bandwidth": {"start": bw_start, "end": bw_end, "used_gb_s": bw},
        "files": files,
        "table": text,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 1 if any(f["errors"] for f in files) else 0


def run_file(model: Path, args: argparse.Namespace, paths: Paths, load: Load, has_server: bool) -> dict[str, Any]:
    """Every arm of `args.arm_set` on one GGUF file, in turn; the file's record."""
    name = model.stem.split(".")[-1].lower() if "." in model.stem else model.stem
    f: dict[str, Any] = {
        "name": name,
        "path": str(model),
        "file_bytes": model.stat().st_size,
        "errors": {},
        "notes": [],
    }
    print(f"[{name}] {model}", flush=True)
    if "llama" in args.arm_set:
        llama_arm(f, args.llama_python, model, load)
    if "weight_bytes" not in f:
        try:
            from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint

            f["weight_bytes"] = GGUFCheckpoint(model).tensor_bytes()
        except Exception as exc:  # noqa: BLE001 - only the share needs it
            f["notes"].append(f"no tensor bytes: {exc}")
    if "pagoda-inproc" in args.arm_set:
        inproc_arm(f, model, load)
    if "pagoda-serve" in args.arm_set:
        serve_arm(f, model, paths, shlex.split(args.pagoda_args), load)
    if load.texts and "llama" in args.arm_set:
        if not has_server:
            f["notes"].append("llama-cpp-python [server] extra not installed: no llama.cpp concurrent-stream run")
        else:
            llama_streams_arm(f, args.llama_python, model, args.run_dir.resolve(), load)
    return f


def llama_arm(f: dict[str, Any], python: Path, model: Path, load: Load) -> None:
    """llama-cpp-python, single stream: `f["llama"]` and the file's tensor bytes."""
    try:
        f["llama"] = run_llama(python, model, load.prompts, load.n_out)
        f["weight_bytes"] = f["llama"]["model_size_bytes"]
        print(
            f"  llama.cpp: decode {f['llama']['decode_tok_s']:.1f} tok/s, prefill "
            f"{f['llama']['prefill_tok_s']:.0f} tok/s, "
            f"{f['weight_bytes']:,} tensor bytes",
            flush=True,
        )
    except Exception as exc:
        f["errors"]["llama"] = f"{type(exc).__name__}: {exc}"
        print(f"  llama.cpp: FAILED: {exc}", flush=True)


def inproc_arm(f: dict[str, Any], model: Path, load: Load) -> None:
    """Pagoda's in-process engine, single stream: `f["pagoda_inproc"]`."""
    n_out = load.n_out
    try:
        f["pagoda_inproc"] = run_inproc(model, load.prompts, n_out)
        bad = [r["tokens"] for r in f["pagoda_inproc"]["runs"] if r["tokens"] != n_out]
        if bad:
            f["notes"].append(f"pagoda-inproc output lengths {bad}, not {n_out}")
        print(f"  pagoda in-process: decode {_f(f['pagoda_inproc']['decode_tok_s'])} tok/s", flush=True)
    except Exception as exc:
        f["errors"]["pagoda_inproc"] = f"{type(exc).__name__}: {exc}"
        print(f"  pagoda in-process: FAILED: {exc}", flush=True)


def serve_arm(f: dict[str, Any], model: Path, paths: Paths, pagoda_args: list[str], load: Load) -> None:
    """`pagoda serve`: the single stream, then the concurrent streams, on one server."""
    arm = ArmSpec("pagoda", model, None, f"pagoda-{f['name']}")
    server = make_server(arm, paths, pagoda_args, [])
    f["pagoda_serve_command"] = server.cmd
    n_out, texts = load.n_out, load.texts

    def work(url: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        single = asyncio.run(pagoda_single(url, load.prompts, n_out))
        streams = None
        if texts:

            def body(text: str) -> dict[str, Any]:
                return {
                    "model": SERVED,
                    "prompt": text,
                    "max_tokens": n_out,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }

            streams = asyncio.run(concurrent_streams(f"{url}/v1/completions", body, texts, n_out))
        return single, streams

    run = with_server(server, work)
    f["pagoda_serve_startup_s"], f["pagoda_serve_survivors"] = run.startup_s, run.survivors
    if run.error:
        f["errors"]["pagoda_serve"] = run.error
    res = run.result
    if res:
        f["pagoda_serve"], f["pagoda_serve_streams"] = res
        if res[0]["length_mismatches"]:
            f["notes"].append(f"pagoda-serve lengths {res[0]['length_mismatches']}")
        if res[1] and res[1]["length_mismatches"]:
            f["notes"].append(f"pagoda 16-stream lengths {res[1]['length_mismatches']}")
        print(
            f"  pagoda serve: decode {_f(res[0]['decode_tok_s'])} tok/s; "
            + (f"{len(texts)} streams {res[1]['aggregate_tok_s']:.1f} tok/s" if res[1] else ""),
            flush=True,
        )


def llama_streams_arm(f: dict[str, Any], python: Path, model: Path, run_dir: Path, load: Load) -> None:
    """llama-cpp-python's server, the concurrent streams: `f["llama_streams"]`."""
    srv = llama_server(python, model, run_dir, SERVED)
    f["llama_server_command"] = srv.cmd
    n_out, texts = load.n_out, load.texts

    def work(url: str) -> dict[str, Any]:
        def body(text: str) -> dict[str, Any]:
            return {
                "model": SERVED,
                "prompt": text,
                "max_tokens": n_out,
                "min_tokens": n_out,
                "temperature": 0.0,
                "stream": True,
            }

        return asyncio.run(concurrent_streams(f"{url}/v1/completions", body, texts, n_out))

    run = with_server(srv, work, wait_healthy=lambda timeout_s: health_wait_llama(srv, timeout_s))
    f["llama_server_startup_s"], f["llama_server_survivors"] = run.startup_s, run.survivors
    if run.error:
        f["errors"]["llama_streams"] = run.error
    res = run.result
    if res:
        f["llama_streams"] = res
        if res["length_mismatches"]:
            f["notes"].append(f"llama.cpp 16-stream lengths {res['length_mismatches']}")
        print(f"  llama.cpp server: {len(texts)} streams {res['aggregate_tok_s']:.1f} tok/s", flush=True)


def add_ratios(f: dict[str, Any], bw: float) -> None:
    """Each arm's decode as a share of the bandwidth bound, and Pagoda's over llama.cpp's."""
    f["bw_share"] = {
        arm: share((f.get(arm) or {}).get("decode_tok_s"), f.get("weight_bytes"), bw)
        for arm in ("llama", "pagoda_serve", "pagoda_inproc")
    }
    ref = (f.get("llama") or {}).get("decode_tok_s")
    f["ratio_vs_llama_decode"] = {
        arm: ((f.get(arm) or {}).get("decode_tok_s") or 0) / ref if ref else None
        for arm in ("pagoda_serve", "pagoda_inproc")
    }


if __name__ == "__main__":
    sys.exit(main())
