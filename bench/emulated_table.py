"""The seed's table on an emulated device (issue 26): async vs sync scheduling at each pipeline size.

    .venv/bin/python -m bench.emulated_table --profile a100-80gb-llama2-70b-tp8 --pp 1,2,4,8 \\
        --out bench/results/emulated_table.json

For each pipeline size and each scheduling mode, one stack (`StackArm`: KV service, stages,
scheduler and gateway, as `pagoda serve` starts them) with every stage on
`--device emulated:PROFILE`, over a config-only model shaped like LLaMA-2-70B (hidden 8192,
vocabulary 32000, bfloat16, `--layers` layers; no weights; the tokenizer of the bench's tiny
model), runs three closed loops through the gateway: `short` (128-token prompts, few output
tokens), `long` (short prompts, `--long-output` tokens) and `mixed` (the two alternating).

Per cell: QPS, output tok/s, each stage's busy fraction and the mean bubble (from the stages'
busy/idle counters over the window in which every client had a request outstanding, as
`bench.stats.service_metrics` takes it), and the control plane's gap per step, from the stages'
compute spans (the scheduler's GetStats include_timeline, polled during the run, so none of
its last 4,096 spans is lost):

  ready gap   on a stage k > 0, the time from its end of one micro-batch to its start of the
              next, counted only when the next one's input had already arrived (its span on
              stage k - 1 ended before this stage became free): time the control plane and the
              transport cost while work waited at the stage;
  stage-0 gap on stage 0 (and at PP=1 the only stage), every gap between two micro-batches
              inside the loaded window: requests were waiting throughout, so this is the
              scheduler's turnaround (planning, KV, the hop), plus, at PP > 1, any wait for a
              group's own feedback token.

and the CPU each process spends per micro-batch (issue 37): the user + system time of the
gateway, the scheduler, the KV service, each stage and this process (the load generator) over the
cell, from /proc/<pid>/stat, divided by stage 0's micro-batches in it (each passes every stage
once), with the cores each kept busy.

`--profile h200-141gb-llama3-8b-tp1` (the fast-step profile) runs a Llama-3-8B-shaped config
instead (`MODEL_SHAPES`); `--loads mixed` runs one load.

The seed's figures (LLaMA-2-70B, A100 x 8 TP, PP=2, batch 32) are printed beside: async vs
sync +30% QPS short, +43% long, +41% mixed; active time 68% -> 89%; bubble < 15%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.arms import EngineSettings, StackArm
from bench.load import closed_loop
from bench.machine import cpu_model
from bench.stats import client_metrics, percentile, service_metrics
from bench.workloads import FULL_SHAPE, Workload, token_space_of

# the config-only model each profile was made for (its "model" block); others get LLaMA-2-70B's
LLAMA2_70B = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
MODEL_SHAPES = {
    "a100-80gb-llama2-70b-tp8": LLAMA2_70B,
    "h200-141gb-llama3-8b-tp1": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
    },
}
LOADS = ("short", "long", "mixed")
# the seed: async over sync, QPS, per load; stage active time sync -> async; bubble bound
SEED_GAIN = {"short": 0.30, "long": 0.43, "mixed": 0.41}
SEED_ACTIVE = {"sync": 0.68, "async": 0.89}
SEED_BUBBLE_MAX = 0.15
# the timeline poll: often enough that the scheduler's last 4,096 spans always reach back to the
# poll before (a quarter of them between polls at the rate just seen), no more often than needed,
# since each poll costs the scheduler CPU that the per-micro-batch figures would count
RECENT_SPANS = 4096
TIMELINE_POLL_S = (0.25, 2.0)  # shortest and longest interval


def next_poll_s(new_spans: int, elapsed_s: float) -> float:
    """The wait before the next timeline poll, after `new_spans` arrived in `elapsed_s`."""
    lo, hi = TIMELINE_POLL_S
    if new_spans <= 0 or elapsed_s <= 0:
        return lo
    return min(hi, max(lo, RECENT_SPANS / 4 / (new_spans / elapsed_s)))


def make_config_dir(folder: Path, num_layers: int | None = None, profile: str = "") -> str:
    """A config.json shaped like the model `profile` was made for (`MODEL_SHAPES`; LLaMA-2-70B
    otherwise), with `num_layers` layers when given, beside the bench's tiny model's tokenizer (its
    ids are the vocabulary's first), no weights (as tests/e2e/test_emulated_device.py)."""
    from wiring import tiny_model

    tiny = tiny_model.default_model_dir(spec=tiny_model.PRESETS["tiny"])
    folder.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(tiny):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(tiny, name), folder / name)
    eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id", 2)
    shape = dict(MODEL_SHAPES.get(profile, LLAMA2_70B))
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                **shape,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "torch_dtype": "bfloat16",
                "bos_token_id": 1,
                "eos_token_id": eos,
                "tie_word_embeddings": False,
            }
        )
    )
    return str(folder)


# --- the control plane's gaps, from the stages' compute spans ----------------------------------


def stage_gaps(spans: list[tuple[int, int, int, int]], window: tuple[int, int]) -> tuple[list[float], list[float]]:
    """(ready gaps of stages k > 0, stage-0 gaps), in ms, of the spans (stage, micro-batch,
    start_ns, end_ns) whose next span starts inside `window` (wall-clock ns)."""
    by_stage: dict[int, list[tuple[int, int, int]]] = {}
    ends: dict[tuple[int, int], int] = {}
    for stage, mb, start, end, *_ in spans:
        by_stage.setdefault(stage, []).append((start, end, mb))
        ends[(stage, mb)] = end
    ready, first = [], []
    lo, hi = window
    for stage, steps in by_stage.items():
        steps.sort()
        for (_, prev_end, _), (start, _, mb) in zip(steps, steps[1:], strict=False):
            if not lo <= start <= hi:
                continue
            gap_ms = (start - prev_end) / 1e6
            if stage == 0:
                first.append(gap_ms)
            elif ends.get((stage - 1, mb), hi + 1) <= prev_end:
                ready.append(gap_ms)
    return ready, first


def max_at_once(spans: list[tuple[int, int, int, int]], window: tuple[int, int]) -> int:
    """The most micro-batches computing at one instant (each on its own stage) in `window`."""
    events = sorted(
        [(s, 1) for _, _, s, e, *_ in spans if window[0] <= s <= window[1]]
        + [(e, -1) for _, _, s, e, *_ in spans if window[0] <= s <= window[1]]
    )
    live = best = 0
    for _, kind in events:  # ends sort before starts at the same instant
        live += kind
        best = max(best, live)
    return best


def _pcts(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99)}


class TimelinePoller:
    """Polls the scheduler's GetStats(include_timeline) and keeps every stage span seen."""

    def __init__(self, address: str) -> None:
        from services.grpc_utils import aio_channel
        from services.pb import scheduler_pb2_grpc

        self._channel = aio_channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self.spans: dict[tuple[int, int], tuple[int, ...]] = {}
        self.feedback_waits = 0  # stage 0's num_feedback_waits at the last poll
        self.kv_steps = 0  # the KV service's Step calls at the last poll (0: not reported)
        self._task: asyncio.Task | None = None

    async def poll_once(self) -> int:
        """One poll; returns how many spans it saw first."""
        from services.pb import scheduler_pb2

        resp = await self._stub.GetStats(scheduler_pb2.GetStatsRequest(include_timeline=True), timeout=10.0)
        self.feedback_waits = sum(s.stats.num_feedback_waits for s in resp.stages if s.stage_index == 0)
        self.kv_steps = resp.kv_cache.num_steps if resp.HasField("kv_cache") else 0
        before = len(self.spans)
        for s in resp.timeline:
            self.spans[(s.stage_index, s.micro_batch_id)] = (
                s.stage_index,
                s.micro_batch_id,
                s.start_ns,
                s.end_ns,
                s.received_ns,
            )
        return len(self.spans) - before

    async def _loop(self) -> None:
        last = time.perf_counter()
        while True:
            new = await self.poll_once()  # (the spans since the poll before)
            now = time.perf_counter()
            wait_s, last = next_poll_s(new, now - last), now
            await asyncio.sleep(wait_s)

    def start(self) -> None:
        self.spans.clear()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> list[tuple[int, int, int, int]]:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.poll_once()
        return sorted(self.spans.values(), key=lambda s: (s[2], s[0]))

    async def close(self) -> None:
        await self._channel.close()


# --- the CPU each process spends ------------------------------------------------------------------


def process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process, all its threads (/proc/<pid>/stat, clock ticks);
    this process when `pid` is None. 0.0 for a process that is gone."""
    if pid is None:
        return time.process_time()
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def arm_cpu_s(arm: StackArm) -> dict[str, float]:
    """CPU seconds so far of every process of the arm, by name (kvcache, scheduler, worker-K,
    gateway), and of this one (`client`: the load generator and the timeline poller)."""
    procs = [*(arm.stack.processes if arm.stack else []), *([arm.gateway] if arm.gateway else [])]
    out = {p.name: process_cpu_s(p.process.pid) for p in procs if p.process is not None}
    out["client"] = process_cpu_s()
    return out


def cpu_per_micro_batch(
    before: dict[str, float], after: dict[str, float], num_micro_batches: int, duration_s: float
) -> dict:
    """What each process spent between two `arm_cpu_s` samples: ms of CPU per micro-batch (stage
    0's micro-batches: each passes every stage once) and the cores it kept busy on average.
    The ticks are 10 ms, so a cell needs a few seconds for a figure to mean anything."""
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
    per_mb = {name: (1e3 * s / num_micro_batches if num_micro_batches else None) for name, s in spent.items()}
    cores = {name: (s / duration_s if duration_s > 0 else None) for name, s in spent.items()}
    return {"num_micro_batches": num_micro_batches, "cpu_s": spent, "ms_per_micro_batch": per_mb, "cores": cores}


# --- one cell ------------------------------------------------------------------------------------


async def measure_cell(arm: StackArm, poller: TimelinePoller, requests, concurrency: int) -> dict:
    """One closed loop of `requests`: the client's rates, the stages' busy and bubble over the
    loaded window, the gaps from the spans in that window."""
    start = await arm.snapshot()
    cpu_before, t_before = arm_cpu_s(arm), time.perf_counter()
    marks = {"t0": time.time_ns()}

    async def at_last_send() -> None:
        marks["s"] = await arm.snapshot()
        marks["t1"] = time.time_ns()

    await poller.poll_once()
    waits0, kv_steps0 = poller.feedback_waits, poller.kv_steps
    poller.start()
    res = await closed_loop(arm.client, requests, concurrency, None, at_last_send)
    spans = await poller.stop()
    end = await arm.snapshot()
    cpu_after, t_after = arm_cpu_s(arm), time.perf_counter()
    loaded = marks.get("s", end)
    services = service_metrics(start, loaded, end)
    client = client_metrics(res.records, res.duration_s)
    window = (marks["t0"], marks.get("t1", time.time_ns()))
    ready, first = stage_gaps(spans, window)
    steps0 = (end.stages[0].num_micro_batches - start.stages[0].num_micro_batches) if end.stages else 0
    return {
        "num_requests": client.num_requests,
        "num_failed": client.num_failed,
        "errors": sorted({str(r.error) for r in res.records if not r.ok})[:5],  # (what failed, when any did)
        "duration_s": client.duration_s,
        "qps": client.requests_per_s,
        "output_tok_s": client.output_tokens_per_s,
        "window_s": (marks.get("t1", marks["t0"]) - marks["t0"]) / 1e9,
        "stage_busy": [round(s.busy_fraction, 4) for s in services.stages],
        "bubble": services.mean_bubble_fraction,
        "num_spans": len(spans),
        "ready_gap": _pcts(ready),
        "stage0_gap": _pcts(first),
        "max_at_once": max_at_once(spans, window),
        "stage0_steps": steps0,
        "stage0_feedback_waits": poller.feedback_waits - waits0,
        "cpu": cpu_per_micro_batch(cpu_before, cpu_after, steps0, t_after - t_before),
        # the scheduler's round trips to the KV service (a decode inside its blocks makes none)
        "kv_steps_per_micro_batch": (poller.kv_steps - kv_steps0) / steps0 if steps0 else None,
        # the loaded window's spans, for the busy-over-time plot (`--plot`)
        "spans": [list(sp) for sp in spans if window[0] <= sp[2] <= window[1]],
    }


async def run_stack(model_dir: str, settings: EngineSettings, args, space, log_dir: Path) -> dict:
    """The three loads on one stack (warmed with a few short requests first)."""
    shape = replace(FULL_SHAPE, short_output=args.short_output, long_output=args.long_output)
    out = {}
    async with StackArm(model_dir, settings, log_dir, "http", args.concurrency) as arm:
        poller = TimelinePoller(arm.stack.scheduler_address)
        try:
            warm = Workload("short", space, shape, args.seed + 1, limit=args.concurrency)
            await closed_loop(arm.client, warm, args.concurrency)
            for load in [x.strip() for x in args.loads.split(",") if x.strip()]:
                if load not in LOADS:
                    raise ValueError(f"--loads: unknown load {load!r}; known: {', '.join(LOADS)}")
                n = args.requests if load != "long" else args.long_requests
                requests = Workload(load, space, shape, args.seed, limit=n)
                out[load] = await measure_cell(arm, poller, requests, args.concurrency)
                _log_cell(settings, load, out[load])
        finally:
            await poller.close()
        out["startup_s"] = arm.startup_s
    return out


def _log_cell(settings: EngineSettings, load: str, c: dict) -> None:
    print(
        f"  PP={settings.pipeline_parallel_size} {'async' if settings.is_async else 'sync ':5} {load:5} "
        f"{c['num_requests']:3} req ({c['num_failed']} failed) {c['duration_s']:6.1f} s  QPS {c['qps']:6.2f}  "
        f"tok/s {c['output_tok_s']:7.1f}  busy {c['stage_busy']}  bubble {c['bubble']:.0%}  "
        f"gaps ready p50 {_ms(c['ready_gap']['p50_ms'])} stage0 p50 {_ms(c['stage0_gap']['p50_ms'])}",
        flush=True,
    )
    if c.get("errors"):
        print(f"    failed: {'; '.join(c['errors'])}", flush=True)
    print(
        f"    CPU ms per micro-batch ({c['stage0_steps']} micro-batches, "
        f"{_num(c.get('kv_steps_per_micro_batch'))} KV round trips each): {_cpu_line(c)}",
        flush=True,
    )


def _cpu_line(c: dict) -> str:
    per_mb = c.get("cpu", {}).get("ms_per_micro_batch", {})
    return ", ".join(f"{name} {_num(v)}" for name, v in sorted(per_mb.items(), key=_process_order))


def _process_order(item: tuple[str, object]) -> tuple[int, str]:
    order = {"gateway": 0, "scheduler": 1, "kvcache": 2, "client": 9}
    name = item[0]
    return (
        order.get(name, 5),
        f"{name.rsplit('-', 1)[0]}-{int(name.rsplit('-', 1)[1]):02d}" if name.startswith("worker-") else name,
    )


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


# --- the table ------------------------------------------------------------------------------------


def table_rows(results: dict) -> list[str]:
    """The markdown table: one row per (PP, load, mode), the seed's figure beside."""
    rows = [
        "| PP | load | mode | req | QPS | out tok/s | async/sync QPS (seed) | stage busy | mean busy (seed) "
        "| bubble (seed) | ready gap p50 / p99 ms | stage-0 gap p50 / p99 ms | µbatches at once | stage-0 feedback waits |",
        "|---:|---|---|---:|---:|---:|---|---|---|---|---|---|---:|---|",
    ]
    for pp, modes in sorted(results["cells"].items(), key=lambda kv: int(kv[0])):
        for load in LOADS:
            for mode in ("sync", "async"):
                c = modes.get(mode, {}).get(load)
                if c is None:
                    continue
                rows.append(_row(pp, load, mode, c, modes))
    return rows


def cpu_rows(results: dict) -> list[str]:
    """The CPU table: one row per (PP, load, mode), each process's ms of CPU per micro-batch
    (workers: the mean over stages, then the busiest) and the cores all of them kept busy."""
    rows = [
        "| PP | load | mode | µbatches | KV round trips / µbatch | gateway | scheduler | kvcache | stage mean / max "
        "| client | cores (all) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for pp, modes in sorted(results["cells"].items(), key=lambda kv: int(kv[0])):
        for load in LOADS:
            for mode in ("sync", "async"):
                c = modes.get(mode, {}).get(load)
                if c is None or "cpu" not in c:
                    continue
                per_mb, cores = c["cpu"]["ms_per_micro_batch"], c["cpu"]["cores"]
                stages = [v for k, v in per_mb.items() if k.startswith("worker-") and v is not None]
                stage = f"{sum(stages) / len(stages):.2f} / {max(stages):.2f}" if stages else "-"
                total = sum(v for v in cores.values() if v is not None)
                rows.append(
                    f"| {pp} | {load} | {mode} | {c['cpu']['num_micro_batches']} "
                    f"| {_num(c.get('kv_steps_per_micro_batch'))} | {_num(per_mb.get('gateway'))} | {_num(per_mb.get('scheduler'))} "
                    f"| {_num(per_mb.get('kvcache'))} | {stage} | {_num(per_mb.get('client'))} | {total:.2f} |"
                )
    return rows


def _row(pp: str, load: str, mode: str, c: dict, modes: dict) -> str:
    gain = "-"
    sync = modes.get("sync", {}).get(load)
    if mode == "async" and sync and sync["qps"]:
        gain = f"{c['qps'] / sync['qps']:.2f}x (+{SEED_GAIN[load]:.0%})"
    busy = " / ".join(f"{b:.0%}" for b in c["stage_busy"])
    mean_busy = sum(c["stage_busy"]) / len(c["stage_busy"]) if c["stage_busy"] else 0.0

    def gaps(g: dict) -> str:
        if not g["n"]:
            return "-"
        return f"{g['p50_ms']:.2f} / {g['p99_ms']:.2f} (n={g['n']})"

    failed = f" ({c['num_failed']} failed)" if c["num_failed"] else ""
    return (
        f"| {pp} | {load} | {mode} | {c['num_requests']}{failed} | {c['qps']:.2f} | {c['output_tok_s']:.0f} "
        f"| {gain} | {busy} | {mean_busy:.0%} ({SEED_ACTIVE[mode]:.0%}) | {c['bubble']:.0%} "
        f"(<{SEED_BUBBLE_MAX:.0%}) | {gaps(c['ready_gap'])} | {gaps(c['stage0_gap'])} "
        f"| {c.get('max_at_once', '-')} | {c.get('stage0_feedback_waits', '-')} / {c.get('stage0_steps', '-')} |"
    )


# --- the command ------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.emulated_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="a100-80gb-llama2-70b-tp8", help="a device profile (services/profiles)")
    p.add_argument("--pp", type=_ints, default=[1, 2, 4, 8], help="pipeline sizes, comma-separated")
    p.add_argument("--modes", default="sync,async", help="scheduling modes, comma-separated")
    p.add_argument("--loads", default=",".join(LOADS), help=f"loads, comma-separated, of {', '.join(LOADS)}")
    p.add_argument(
        "--layers", type=int, default=None, help="the config's layers (default: the profile's model's, LLaMA-2-70B: 80)"
    )
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients (the seed's batch: 32)")
    p.add_argument("--requests", type=int, default=96, help="requests per short and mixed cell")
    p.add_argument("--long-requests", type=int, default=64, help="requests per long cell")
    p.add_argument("--short-output", type=int, default=8, help="output tokens of a short request")
    p.add_argument(
        "--long-output",
        type=int,
        default=128,
        help="output tokens of a long request (the seed: 4096; scaled down for time)",
    )
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/emulated_table.json"))
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="also draw each PP's stages busy over time (mixed load, sync and async) to this PNG",
    )
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="only print the table (and --plot) from a saved results file",
    )
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> dict:
    from services.text import Tokenizer

    work = Path(tempfile.mkdtemp(prefix="pagoda-emulated-table-"))
    model_dir = make_config_dir(work / "config-only", args.layers, args.profile)
    space = token_space_of(Tokenizer(model_dir))
    device = f"emulated:{args.profile}"
    results = {
        "meta": {
            "command": "python -m bench.emulated_table " + " ".join(sys.argv[1:]),
            "device": device,
            "layers": json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"],
            "cpu_model": cpu_model(),
            "concurrency": args.concurrency,
            "short_output": args.short_output,
            "long_output": args.long_output,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        },
        "cells": {},
    }
    t0 = time.perf_counter()
    for pp in args.pp:
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            settings = EngineSettings(
                pipeline_parallel_size=pp,
                async_scheduling=mode == "async",
                total_threads=pp,
                num_kv_blocks=args.num_kv_blocks,
                device=device,
            )
            print(f"[{device}] {settings.describe()}", flush=True)
            cell = await run_stack(model_dir, settings, args, space, work / "logs" / f"pp{pp}-{mode}")
            results["cells"].setdefault(str(pp), {})[mode] = cell
    results["meta"]["elapsed_s"] = time.perf_counter() - t0
    shutil.rmtree(work / "config-only", ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.render is not None:
        results = json.loads(args.render.read_text())
    else:
        results = asyncio.run(run(args))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    print("\n".join(table_rows(results)))
    print("\nCPU per micro-batch, ms (each process's utime + stime over the cell / stage 0's micro-batches):")
    print("\n".join(cpu_rows(results)))
    if args.plot is not None:
        from bench.plots import emulated_busy

        print(f"plot: {emulated_busy(results, args.plot)}")
    if args.render is None:
        print(f"\nwrote {args.out}; {results['meta']['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
