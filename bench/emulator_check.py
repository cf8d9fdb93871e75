"""The emulator checked against the real stack (issue 26): the same load on the same model, once
computed and once emulated with the `cpu-local` profile, at PP = 1 and 2.

    .venv/bin/python -m bench.emulator_check --model ~/.cache/pagoda-anchor/smol135 \
        --out bench/results/emulator_check.json

For each pipeline size, two stacks one after the other, alike but for the stages' device: the
real one computes the model (as `pagoda serve` loads it: `--dtype auto`, bfloat16 weights for
a float32 checkpoint on AVX-512 BF16; one torch thread per stage), as `bench/fit_profile.py`
times it to fit `cpu-local`; the emulated one (`--device emulated:cpu-local`) waits the
profile's step time instead. Both serve the same closed loop of the mixed load (short and long
requests alternating, `ignore_eos`) through the gateway. Printed per pipeline size: output
tok/s, QPS, TTFT and TPOT (p50) of each and the emulated over the real; within 10% is the
issue's bar.

What the emulator cannot model on this machine: on the real stack the stages' compute shares
the two cores with the gateway, scheduler and KV service (at PP=2 each stage has a core of its
own only while the services are idle); an emulated stage sleeps and leaves its core to them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.arms import EngineSettings, StackArm
from bench.load import closed_loop
from bench.stats import client_metrics
from bench.workloads import FULL_SHAPE, Workload, token_space_of

DEFAULT_MODEL = Path.home() / ".cache" / "pagoda-anchor" / "smol135"
TOLERANCE = 0.10
FIGURES = (
    ("output_tok_s", "out tok/s"),
    ("qps", "QPS"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("tpot_p50_ms", "TPOT p50 ms"),
)


async def run_arm(model_dir: str, settings: EngineSettings, args, log_dir: Path) -> dict:
    """One stack: warmed with a few short requests, then the mixed load's closed loop."""
    from services.text import Tokenizer

    space = token_space_of(Tokenizer(model_dir))
    shape = replace(FULL_SHAPE, long_output=args.long_output)
    async with StackArm(model_dir, settings, log_dir, "http", args.concurrency) as arm:
        await closed_loop(arm.client, Workload("short", space, shape, args.seed + 1, limit=4), 4)
        res = await closed_loop(
            arm.client, Workload("mixed", space, shape, args.seed, limit=args.requests), args.concurrency
        )
    m = client_metrics(res.records, res.duration_s)
    return {
        "num_requests": m.num_requests,
        "num_failed": m.num_failed,
        "duration_s": m.duration_s,
        "output_tok_s": m.output_tokens_per_s,
        "qps": m.requests_per_s,
        "ttft_p50_ms": m.ttft.p50_ms,
        "tpot_p50_ms": m.tpot.p50_ms,
    }


def ratios(real: dict, emulated: dict) -> dict[str, float | None]:
    """Emulated over real, per figure (None where either is missing)."""
    return {
        key: (emulated[key] / real[key] if real.get(key) and emulated.get(key) is not None else None)
        for key, _ in FIGURES
    }


def table(results: dict) -> list[str]:
    head = "| PP | arm | " + " | ".join(label for _, label in FIGURES) + " |"
    lines = [head, "|---:|---|" + "---:|" * len(FIGURES)]
    for pp, cell in results["cells"].items():
        for arm in ("real", "emulated"):
            c = cell[arm]
            lines.append(
                f"| {pp} | {arm} | " + " | ".join(f"{c[k]:.1f}" if c[k] is not None else "-" for k, _ in FIGURES) + " |"
            )
        shown = []
        for key, _ in FIGURES:
            r = cell["ratio"][key]
            shown.append("-" if r is None else f"{r:.2f}x {'ok' if abs(r - 1) <= TOLERANCE else 'MISS'}")
        lines.append(f"| {pp} | emulated / real | " + " | ".join(shown) + " |")
    return lines


async def run(args: argparse.Namespace) -> dict:
    model_dir = str(args.model.expanduser())
    work = Path(tempfile.mkdtemp(prefix="pagoda-emulator-check-"))
    results = {
        "meta": {
            "command": "python -m bench.emulator_check " + " ".join(sys.argv[1:]),
            "model": model_dir,
            "profile": args.profile,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "long_output": args.long_output,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        },
        "cells": {},
    }
    for pp in args.pp:
        cell = {}
        for arm, device in (("real", None), ("emulated", f"emulated:{args.profile}")):
            settings = EngineSettings(pipeline_parallel_size=pp, total_threads=pp, device=device)
            print(f"[{arm}] {settings.describe()}", flush=True)
            cell[arm] = await run_arm(model_dir, settings, args, work / f"pp{pp}-{arm}")
            print(f"  {json.dumps(cell[arm])}", flush=True)
        cell["ratio"] = ratios(cell["real"], cell["emulated"])
        results["cells"][str(pp)] = cell
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a checkpoint folder (default: %(default)s)")
    p.add_argument("--profile", default="cpu-local")
    p.add_argument("--pp", default="1,2", help="pipeline sizes, comma-separated")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=48, help="requests of the mixed load per arm")
    p.add_argument("--long-output", type=int, default=64, help="output tokens of a long request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/emulator_check.json"))
    args = p.parse_args(argv)
    args.pp = [int(x) for x in args.pp.split(",") if x.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print("\n".join(table(results)))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
