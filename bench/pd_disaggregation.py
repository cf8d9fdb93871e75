"""P/D disaggregation against aggregated replicas of the same total size (issue 39).

    .venv/bin/python -m bench.pd_disaggregation              # emulated A100 pair, a few minutes
    .venv/bin/python -m bench.pd_disaggregation --real       # the real model: transfer per sequence

Emulated (the default): every stage `--device emulated:a100-80gb-llama2-70b-tp8` over a
config-only LLaMA-2-70B (bench.emulated_table.make_config_dir: 80 layers, 8 KV heads, bfloat16,
4,096 positions), PP=1 per replica, each replica a KV service, one stage and a scheduler
(wiring.launcher.start_stack) behind one gateway:

  (A) aggregated: replicas r0 and r1, the gateway routing by load (`--scheduler r0=..,r1=..`);
  (B) disaggregated: prefill replica p0 and decode replica d0 (`--kv-import-blocks`), the gateway
      with `--scheduler d0=.. --prefill-scheduler p0=..` (gateway/disaggregation.py).

The same load on both: `--chats` chats (prompts of `--chat-prompt` tokens, `--chat-output` tokens
each, enough to run through the whole measurement) start first; once every chat has streamed a
token and `--warmup` seconds have passed, `--long` long prompts of `--long-prompt` tokens
(`--long-output` tokens each) are sent one every `--interval` seconds. The window runs from the
first long prompt's send to the last one's last token. Reported per arm: the chats' inter-token
latency (the gaps between one chat's consecutive tokens, both inside the window) p50/p99/max, the
long prompts' TTFT p50/p99, and for B the decode replica's pulls over the window
(GetStats.disaggregation: blocks, bytes and seconds per imported sequence); then B over A.
Every token's arrival is taken from the gateway's gRPC Generate stream (the token ids of one
delta share its arrival). Greedy, `ignore_eos`: lengths are exact.

`--real`: SmolLM2-135M-Instruct (the float32 folder of /work/shared/anchors/real-model.md at
~/.cache/pagoda-anchor/smol135, or `--real-model`; `--dtype float32`), PP=1, one thread per
stage: the aggregated single replica, then 1 prefill + 1 decode replica, each sent the same
prompts one at a time (`--real-lengths`, random token ids, 16 greedy tokens with ignore_eos).
Per prompt: TTFT in both arms and, for P/D, the decode replica's pull (blocks, bytes, seconds:
GetStats.disaggregation before and after); and whether the two arms' outputs are equal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.machine import cpu_model
from bench.stats import percentile

PROFILE = "a100-80gb-llama2-70b-tp8"
REAL_MODEL = Path("~/.cache/pagoda-anchor/smol135").expanduser()
DISAGG_FIELDS = ("num_import_requests", "num_imported", "num_imported_blocks", "num_imported_bytes", "import_seconds")


@dataclass
class Stream:
    """One request as the client saw it: when it was sent, when each token arrived."""

    kind: str  # "chat", "long" or "prompt"
    prompt_len: int
    sent_s: float = 0.0
    token_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.sent_s if self.token_s else None

    @property
    def done_s(self) -> float | None:
        return self.token_s[-1] if self.token_s else None


# --- the figures (pure) -------------------------------------------------------------------------


def itl_gaps(streams: Sequence[Stream], window: tuple[float, float]) -> list[float]:
    """Seconds between consecutive tokens of each stream, both arrivals inside `window`."""
    lo, hi = window
    gaps = []
    for s in streams:
        inside = [t for t in s.token_s if lo <= t <= hi]
        gaps += [b - a for a, b in zip(inside, inside[1:], strict=False)]
    return gaps


def summary_ms(seconds: Sequence[float]) -> dict:
    """Count, p50, p99 and max in milliseconds (None where there is nothing)."""
    ms = [s * 1e3 for s in seconds]
    return {"n": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms) if ms else None}


def pulls_per_sequence(before: dict, after: dict) -> dict:
    """The decode replica's pulls between two GetStats.disaggregation snapshots, per sequence
    whose KV it imported."""
    delta = {k: after[k] - before[k] for k in DISAGG_FIELDS}
    n = delta["num_imported"]
    return {
        **delta,
        "blocks_per_seq": delta["num_imported_blocks"] / n if n else None,
        "bytes_per_seq": delta["num_imported_bytes"] / n if n else None,
        "pull_ms_per_seq": delta["import_seconds"] / n * 1e3 if n else None,
    }


def ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def prompts(seed: int, lengths: Sequence[int], low: int = 5, high: int = 500) -> list[list[int]]:
    """Random token ids (no two prompts share a prefix block)."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(n)] for n in lengths]


# --- the stacks ---------------------------------------------------------------------------------


@dataclass
class Cluster:
    """Replicas (each a KV service, one stage, a scheduler) and the gateway in front of them."""

    stacks: dict[str, object]  # name -> wiring.launcher.Stack
    gateway: object  # wiring.launcher.ServiceProcess
    grpc_address: str

    def scheduler(self, name: str) -> str:
        return self.stacks[name].scheduler_address

    def commands(self) -> list[str]:
        procs = [p for s in self.stacks.values() for p in s.processes] + [self.gateway]
        return [f"{p.name}: {shlex.join(p.command)}" for p in procs]

    def stop(self) -> None:
        self.gateway.stop(10.0)
        for s in self.stacks.values():
            s.stop(10.0)


def start_cluster(
    model_dir: str, roles: Sequence[tuple[str, str]], args, worker_flags: Sequence[str], log_dir: Path
) -> Cluster:
    """One replica per (name, role) ("decode": with an import area), then the gateway: load
    routing over the decode (or aggregated) replicas, `--prefill-scheduler` over the prefill ones."""
    from wiring.launcher import ServiceProcess, free_port, pagoda_command, start_stack

    stacks: dict[str, object] = {}
    gateway = None
    sched = ("--max-num-seqs", "64", "--max-model-len", str(args.max_model_len))
    try:
        for name, role in roles:
            (log_dir / name).mkdir(parents=True, exist_ok=True)
            imports = ("--kv-import-blocks", str(args.import_blocks)) if role == "decode" else ()
            stacks[name] = start_stack(
                model_dir,
                num_stages=1,
                num_kv_blocks=args.num_kv_blocks,
                log_dir=log_dir / name,
                scheduler_args=sched,
                worker_args=(*worker_flags, *imports),
                kvcache_args=imports,
                threads_per_worker=1,
                env={"TOKENIZERS_PARALLELISM": "false"},
            )
        targets = ",".join(f"{n}={stacks[n].scheduler_address}" for n, r in roles if r != "prefill")
        prefill = ",".join(f"{n}={stacks[n].scheduler_address}" for n, r in roles if r == "prefill")
        port, grpc_port = free_port(), free_port()
        command = ["gateway", "--model", model_dir, "--scheduler", targets, "--port", str(port)]
        command += ["--grpc-port", str(grpc_port), "--max-model-len", str(args.max_model_len)]
        command += ["--prefill-scheduler", prefill] if prefill else []
        gateway = ServiceProcess(
            "gateway", pagoda_command(*command), f"127.0.0.1:{grpc_port}", log_path=log_dir / "gateway.log"
        )
        gateway.start()
        gateway.wait_healthy(120)
    except BaseException:
        if gateway is not None:
            gateway.stop(5.0)
        for s in stacks.values():
            s.stop(5.0)
        raise
    return Cluster(stacks, gateway, f"127.0.0.1:{grpc_port}")


async def disaggregation(address: str) -> dict:
    """A scheduler's GetStats.disaggregation as a dict of `DISAGG_FIELDS`."""
    from services.grpc_utils import aio_channel
    from services.pb import scheduler_pb2, scheduler_pb2_grpc

    async with aio_channel(address) as channel:
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
    return {k: getattr(stats.disaggregation, k) for k in DISAGG_FIELDS}


async def generate(stub, record: Stream, prompt: list[int], max_tokens: int) -> None:
    """Stream one request through the gateway's gRPC API into `record` (errors recorded)."""
    from services.pb import common_pb2, gateway_pb2

    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = gateway_pb2.TextGenerateRequest(
        token_ids=gateway_pb2.PromptTokenIds(ids=prompt),
        options=gateway_pb2.TextGenerationOptions(sampling_params=sampling),
    )
    record.sent_s = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=600):
            now = time.perf_counter()
            for delta in response.choices:
                record.token_s += [now] * len(delta.token_ids)
                record.token_ids += list(delta.token_ids)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed request is a figure, not a crash
        record.error = f"{type(exc).__name__}: {exc}"[:300]


# --- the emulated pair --------------------------------------------------------------------------


async def emulated_load(cluster: Cluster, args, decode_replica: str) -> dict:
    """The chats, then the long prompts among them; the figures of one arm."""
    from services.grpc_utils import aio_channel
    from services.pb import gateway_pb2_grpc

    chat_prompts = prompts(1, [args.chat_prompt] * args.chats)
    long_prompts = prompts(2, [args.long_prompt] * args.long)
    chats = [Stream("chat", args.chat_prompt) for _ in chat_prompts]
    longs = [Stream("long", args.long_prompt) for _ in long_prompts]
    async with aio_channel(cluster.grpc_address) as channel:
        stub = gateway_pb2_grpc.GenerationStub(channel)
        chat_tasks = [
            asyncio.create_task(generate(stub, s, p, args.chat_output))
            for s, p in zip(chats, chat_prompts, strict=True)
        ]
        try:
            await _until(lambda: all(s.token_s or s.error for s in chats), 300, "every chat's first token")
            await asyncio.sleep(args.warmup)
            before = await disaggregation(cluster.scheduler(decode_replica))
            start = time.perf_counter()
            long_tasks = []
            for i, (s, p) in enumerate(zip(longs, long_prompts, strict=True)):
                await asyncio.sleep(max(0.0, start + i * args.interval - time.perf_counter()))
                long_tasks.append(asyncio.create_task(generate(stub, s, p, args.long_output)))
            await asyncio.gather(*long_tasks)
            after = await disaggregation(cluster.scheduler(decode_replica))
        finally:
            for t in chat_tasks:
                t.cancel()
            await asyncio.gather(*chat_tasks, return_exceptions=True)
    end = max((s.done_s for s in longs if s.done_s), default=time.perf_counter())
    window = (start, end)
    return {
        "window_s": end - start,
        "chat_itl": summary_ms(itl_gaps(chats, window)),
        # chats cancelled unfinished once the window closed: they ran through all of it
        "chats_throughout": sum(1 for s in chats if 0 < len(s.token_ids) < args.chat_output and not s.error),
        "long_ttft": summary_ms([s.ttft_s for s in longs if s.ttft_s is not None]),
        "long_done": sum(1 for s in longs if len(s.token_ids) == args.long_output),
        "errors": [s.error for s in (*chats, *longs) if s.error and "CANCELLED" not in s.error],
        "pulls": pulls_per_sequence(before, after),
    }


async def _until(ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        await asyncio.sleep(0.05)


def emulated_arms(args, log_root: Path) -> dict:
    from bench.emulated_table import make_config_dir

    model_dir = make_config_dir(log_root / "model", profile=args.profile)
    flags = ("--device", f"emulated:{args.profile}")
    layouts = {"A": [("r0", ""), ("r1", "")], "B": [("p0", "prefill"), ("d0", "decode")]}
    results = {}
    for arm, roles in layouts.items():
        names = ", ".join(f"{n} ({r or 'aggregated'})" for n, r in roles)
        print(f"arm {arm}: {names} ...", flush=True)
        cluster = start_cluster(model_dir, roles, args, flags, log_root / arm)
        try:
            results[arm] = asyncio.run(emulated_load(cluster, args, roles[-1][0]))
            results[arm]["commands"] = cluster.commands()
        finally:
            cluster.stop()
    return results


def print_emulated(results: dict, args) -> None:
    a, b = results["A"], results["B"]
    print(f"\nemulated {args.profile}, PP=1 per replica, 2 replicas per arm; CPU: {cpu_model('?')}")
    print(
        f"load: {args.chats} chats ({args.chat_prompt}-token prompts, {args.chat_output} tokens), {args.long} prompts "
        f"of {args.long_prompt} tokens ({args.long_output} tokens) one every {args.interval} s"
    )
    print(f"{'arm':<22} {'ITL p50':>8} {'p99':>8} {'max':>8} {'gaps':>6} {'TTFT p50':>9} {'p99':>8} {'window':>7}")
    for name, r in (("A aggregated 2 x r", a), ("B 1 prefill + 1 decode", b)):
        itl, ttft = r["chat_itl"], r["long_ttft"]
        print(
            f"{name:<22} {fmt(itl['p50_ms']):>8} {fmt(itl['p99_ms']):>8} {fmt(itl['max_ms']):>8} {itl['n']:>6} "
            f"{fmt(ttft['p50_ms']):>9} {fmt(ttft['p99_ms']):>8} {r['window_s']:>6.1f}s"
        )
    ratios = {
        "ITL p50": ratio(b["chat_itl"]["p50_ms"], a["chat_itl"]["p50_ms"]),
        "ITL p99": ratio(b["chat_itl"]["p99_ms"], a["chat_itl"]["p99_ms"]),
        "TTFT p50": ratio(b["long_ttft"]["p50_ms"], a["long_ttft"]["p50_ms"]),
        "TTFT p99": ratio(b["long_ttft"]["p99_ms"], a["long_ttft"]["p99_ms"]),
    }
    print("B / A: " + ", ".join(f"{k} {fmt(v, '.2f')}" for k, v in ratios.items()))
    p = b["pulls"]
    print(
        f"B's pulls in the window: {p['num_imported']} sequences, {fmt(p['blocks_per_seq'])} blocks, "
        f"{fmt(p['bytes_per_seq'] and p['bytes_per_seq'] / 1e6)} MB (modelled), {fmt(p['pull_ms_per_seq'], '.2f')} ms "
        "per sequence (plan + pull + commit)"
    )
    for name, r in (("A", a), ("B", b)):
        done = f"{r['long_done']}/{args.long} long prompts answered, {r['chats_throughout']} chats ran throughout"
        print(f"{name}: {done}; {len(r['errors'])} errors {r['errors'][:2]}")
    results["ratios"] = ratios


# --- the real model -----------------------------------------------------------------------------


async def real_load(cluster: Cluster, args, decode_replica: str | None) -> list[dict]:
    """Each prompt alone through the gateway: its TTFT, output and (P/D) its pull."""
    from services.grpc_utils import aio_channel
    from services.pb import gateway_pb2_grpc

    lengths = [int(n) for n in args.real_lengths.split(",")]
    rows = []
    async with aio_channel(cluster.grpc_address) as channel:
        stub = gateway_pb2_grpc.GenerationStub(channel)
        await generate(stub, Stream("warmup", 64), prompts(3, [64], 100, 40000)[0], 4)
        for n, prompt in zip(lengths, prompts(4, lengths, 100, 40000), strict=True):
            before = await disaggregation(cluster.scheduler(decode_replica)) if decode_replica else None
            record = Stream("prompt", n)
            await generate(stub, record, prompt, 16)
            row = {"prompt_len": n, "ttft_ms": record.ttft_s and record.ttft_s * 1e3, "tokens": record.token_ids}
            row["error"] = record.error
            if decode_replica:
                row["pull"] = pulls_per_sequence(before, await disaggregation(cluster.scheduler(decode_replica)))
            rows.append(row)
    return rows


def real_arms(args, log_root: Path) -> dict:
    model_dir = str(Path(args.real_model).expanduser())
    # a real pool holds memory (737 KB a block here): 512 blocks, 8,192 tokens, per replica
    args = argparse.Namespace(**{**vars(args), "num_kv_blocks": args.real_kv_blocks, "import_blocks": 256})
    flags = ("--dtype", "float32")
    results = {}
    for arm, roles in (("aggregated", [("r0", "")]), ("pd", [("p0", "prefill"), ("d0", "decode")])):
        print(f"real arm {arm} ...", flush=True)
        cluster = start_cluster(model_dir, roles, args, flags, log_root / arm)
        try:
            results[arm] = asyncio.run(real_load(cluster, args, "d0" if arm == "pd" else None))
        finally:
            cluster.stop()
        results[f"{arm}_commands"] = cluster.commands()
    return results


def print_real(results: dict, args) -> None:
    print(f"\nreal model {args.real_model}, float32, PP=1, 1 thread per stage; CPU: {cpu_model('?')}")
    print(
        f"{'prompt':>6} {'TTFT agg':>9} {'TTFT P/D':>9} {'P/D/agg':>8} {'blocks':>7} {'MB':>7} {'pull ms':>8} "
        f"{'ms/block':>8} {'same':>5}"
    )
    for agg, pd in zip(results["aggregated"], results["pd"], strict=True):
        pull = pd["pull"]
        blocks = pull["num_imported_blocks"]
        pull_ms = pull["import_seconds"] * 1e3
        print(
            f"{agg['prompt_len']:>6} {fmt(agg['ttft_ms']):>9} {fmt(pd['ttft_ms']):>9} "
            f"{fmt(ratio(pd['ttft_ms'], agg['ttft_ms']), '.2f'):>8} {blocks:>7} {pull['num_imported_bytes'] / 1e6:>7.1f} "
            f"{pull_ms:>8.1f} {fmt(pull_ms / blocks if blocks else None, '.2f'):>8} "
            f"{'yes' if agg['tokens'] == pd['tokens'] and agg['tokens'] else 'NO':>5}"
        )
    errors = [r["error"] for arm in ("aggregated", "pd") for r in results[arm] if r["error"]]
    print(f"errors: {errors or 'none'}")


# --- the command line ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real", action="store_true", help="the real model's arms instead of the emulated pair")
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--chats", type=int, default=32)
    ap.add_argument("--chat-prompt", type=int, default=512)
    ap.add_argument("--chat-output", type=int, default=3000)
    ap.add_argument("--long", type=int, default=12)
    ap.add_argument("--long-prompt", type=int, default=4080, help="with --long-output, at most the 4,096 positions")
    ap.add_argument("--long-output", type=int, default=16)
    ap.add_argument("--interval", type=float, default=1.5, help="seconds between long prompts")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of chats alone before the long prompts")
    ap.add_argument("--num-kv-blocks", type=int, default=16384, help="the emulated replicas' pools (no memory held)")
    ap.add_argument("--import-blocks", type=int, default=2048, help="the decode replica's --kv-import-blocks")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--real-model", default=str(REAL_MODEL))
    ap.add_argument("--real-lengths", default="1024,1024,2048,2048")
    ap.add_argument("--real-kv-blocks", type=int, default=512)
    ap.add_argument("--log-dir", type=Path, default=None, help="the services' logs (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"command: {shlex.join([sys.executable, '-m', 'bench.pd_disaggregation', *(argv or sys.argv[1:])])}")
    print(f"CPU: {cpu_model('?')}, date {time.strftime('%Y-%m-%d')}", flush=True)
    with contextlib.ExitStack() as stack:
        log_root = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pd-bench-")))
        if args.real:
            results = real_arms(args, log_root)
            print_real(results, args)
            commands = results["pd_commands"]
        else:
            results = emulated_arms(args, log_root)
            print_emulated(results, args)
            commands = results["B"]["commands"]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_model("?"), "args": vars(args), "results": results}, default=str))
    print("\nthe services of the last arm:\n  " + "\n  ".join(commands))


if __name__ == "__main__":
    main()
