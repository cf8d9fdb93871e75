"""`pagoda bench`: the benchmark harness's command line (the harness itself is `bench/`).

    pagoda bench --quick --plot --out bench/results

runs every comparison of issue 7 on the tiny model and (a), (b), (d) on the ~25M one, with
about 20 s of load per arm, and writes results.json, results.md and (with --plot) PNGs.
Without --quick: both models, every comparison, a wider sweep, 60 s per arm, full lengths.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.runner import ModelResults, Plan

QUICK_COMPARISONS = {"tiny": "a,b,c,d,e,f", "25m": "a,b,d"}


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in _csv(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in _csv(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    _add_harness_arguments(p)
    _add_serving_arguments(p)


def _add_harness_arguments(p: argparse.ArgumentParser) -> None:
    """The harness's own runs: which models and comparisons, how much load, where results go."""
    p.add_argument(
        "--quick", action="store_true", help="the `make bench` run: under 10 minutes on 2 cores, scaled-down lengths"
    )
    p.add_argument("--plot", action="store_true", help="also write PNG plots (needs matplotlib)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder")
    p.add_argument(
        "--models",
        type=_csv,
        default=("tiny", "25m"),
        help="tiny-model presets to run, comma-separated (default: tiny,25m)",
    )
    p.add_argument(
        "--comparisons",
        type=_csv,
        default=None,
        help="a..f, comma-separated, for every model (default: --quick: all on tiny, a,b,d on 25m; otherwise all)",
    )
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients; the baseline's batch size")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of load that fix each comparison's request count (default 20 quick, 60)",
    )
    p.add_argument(
        "--sweep",
        type=_ints,
        default=None,
        help="concurrencies for throughput vs concurrency (default quick 1,4,16; 1,2,4,8,16,32)",
    )
    p.add_argument(
        "--open-loop-loads",
        type=_floats,
        default=None,
        help="Poisson rates as fractions of the closed-loop request rate (default quick 0.7)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads in all, the same for every arm (default: usable cores)"
    )
    p.add_argument(
        "--driver",
        choices=["auto", "http", "grpc"],
        default="auto",
        help="load through the gateway over HTTP, or straight to the scheduler over gRPC "
        "(auto: HTTP when this checkout has `pagoda gateway`)",
    )
    p.add_argument(
        "--chunked-budget", type=int, default=64, help="max_num_batched_tokens of the chunked-prefill-on arm of (e)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="the stages' --device for every stack arm, e.g. emulated:a100-80gb-llama2-70b-tp8 "
        "(each forward pass a modelled wait; every table says so; default: the server's)",
    )
    p.add_argument("--log-dir", type=Path, default=None, help="service logs (default: a temp folder)")
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="only render results.md (and plots with --plot) from a saved results.json",
    )


def _add_serving_arguments(p: argparse.ArgumentParser) -> None:
    """With --base-url: the same workload against running OpenAI-compatible servers."""
    serving = p.add_argument_group(
        "any OpenAI-compatible server",
        "with --base-url: drive running servers (Pagoda, vLLM, ...) with the same "
        "workload one after the other and compare them in one table (serving.json, serving.md in --out)",
    )
    serving.add_argument(
        "--base-url",
        action="append",
        default=[],
        metavar="[LABEL=]URL",
        help="a server's root, e.g. pagoda=http://127.0.0.1:8000 (repeat for each server)",
    )
    serving.add_argument("--model", help="the served model name to send (with --base-url)")
    serving.add_argument("--tokenizer", help="the model's folder, for prompt token ids (default: --model)")
    serving.add_argument("--workload", default="mixed", help="short, long, mixed or shared-prefix (default: mixed)")
    serving.add_argument("--num-requests", type=int, default=64, help="requests per server (default: 64)")
    serving.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput's TTFT bound (default: 1000)")
    serving.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput's TPOT bound (default: 100)")
    serving.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for every max_tokens token (vLLM's extra; default: on)",
    )


def _import_bench():
    try:
        import bench  # noqa: F401
    except ImportError:
        # the editable install maps only the service packages; `bench/` sits beside them
        root = Path(__file__).resolve().parent.parent
        if not (root / "bench" / "__init__.py").is_file():
            raise
        sys.path.insert(0, str(root))


def build_plan(args: argparse.Namespace):
    from bench.arms import cpu_count
    from bench.runner import ModelPlan, Plan
    from bench.workloads import FULL_SHAPE, QUICK_SHAPE
    from wiring.tiny_model import PRESETS

    unknown = [m for m in args.models if m not in PRESETS]
    if unknown:
        raise ValueError(f"--models: unknown preset(s) {unknown}; known: {', '.join(sorted(PRESETS))}")
    quick = args.quick
    sweep = args.sweep if args.sweep is not None else ((1, 4, 16) if quick else (1, 2, 4, 8, 16, 32))
    loads = args.open_loop_loads if args.open_loop_loads is not None else ((0.7,) if quick else (0.25, 0.5, 0.75, 1.0))
    models = []
    for i, preset in enumerate(args.models):
        if args.comparisons is not None:
            comps = args.comparisons
        else:
            comps = _csv(QUICK_COMPARISONS.get(preset, "a,b,d")) if quick else ("a", "b", "c", "d", "e", "f")
        first = i == 0
        models.append(
            ModelPlan(
                preset,
                tuple(comps),
                num_kv_blocks=2048 if preset == "tiny" else 1536,
                sweep=sweep if (first or not quick) else (),
                open_loop_loads=loads if (first or not quick) else (),
            )
        )
    threads = args.threads or max(2, cpu_count() // 2 * 2)  # even: (c) splits it over 2 stages
    return Plan(
        models=tuple(models),
        quick=quick,
        shape=QUICK_SHAPE if quick else FULL_SHAPE,
        concurrency=args.concurrency,
        duration_s=args.duration or (20.0 if quick else 60.0),
        sweep_duration_s=6.0 if quick else 20.0,
        open_loop_duration_s=10.0 if quick else 30.0,
        total_threads=threads,
        chunked_budget=args.chunked_budget,
        gantt_s=3.0,
        seed=args.seed,
        driver="http",
        device=getattr(args, "device", None),
    )


def _prepare_model(preset: str):
    from bench.workloads import token_space_of
    from services.text import Tokenizer
    from wiring import tiny_model

    spec = tiny_model.PRESETS[preset]
    model_dir = str(tiny_model.default_model_dir(spec=spec))
    return model_dir, token_space_of(Tokenizer(model_dir)), spec.num_parameters


def _write(results: dict, out: Path, plot: bool, log) -> list[str]:
    from bench.report import render_markdown, write_json

    plots: list[str] = []
    if plot:
        from bench.plots import write_plots

        plots = [str(p) for p in write_plots(results, out)]
    write_json(results, out / "results.json")
    (out / "results.md").write_text(render_markdown(results, plots))
    log(f"wrote {out / 'results.json'}, {out / 'results.md'}" + (f" and {len(plots)} plot file(s)" if plots else ""))
    return plots


def run_bench(args: argparse.Namespace) -> int:
    import asyncio
    import os

    _import_bench()
    if args.base_url:
        from bench.serving import run

        return run(args)
    from bench.report import load_average
    from bench.runner import Runner

    def log(msg: str) -> None:
        print(msg, flush=True)

    if args.render is not None:
        import json

        results = json.loads(args.render.read_text())
        _write(results, args.out, args.plot, log)
        return 0
    plan = _checked_plan(args)
    if plan is None:
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S %Z"), time.perf_counter()
    load_start = load_average()
    log(
        f"pagoda bench: {'quick' if plan.quick else 'full'} run, models {', '.join(m.preset for m in plan.models)}, "
        f"{plan.total_threads} torch thread(s) per arm, concurrency {plan.concurrency}, driver {plan.driver}"
    )
    runner = Runner(plan, log=log, log_dir=args.log_dir)
    log(f"  service logs: {runner.log_dir}")
    try:
        models = asyncio.run(runner.run(_prepare_model))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    results = _results(plan, models, started, t0, load_start)
    return _report(results, args, log)


def _checked_plan(args: argparse.Namespace) -> Plan | None:
    """The plan of `args` with its driver resolved; None (the error printed) when it cannot run."""
    import dataclasses

    from bench.arms import gateway_available

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return None
    try:
        plan = build_plan(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    driver = args.driver
    if driver == "auto":
        driver = "http" if gateway_available() else "grpc"
    return dataclasses.replace(plan, driver=driver)


def _results(plan: Plan, models: list[ModelResults], started: str, t0: float, load_start: list[float] | None) -> dict:
    """results.json: the run's metadata and notes, the plan and every model's runs."""
    import dataclasses
    import json
    import shlex

    from bench.report import load_average, machine_info

    driver = plan.driver
    driver_note = (
        "HTTP: the gateway's POST /v1/completions, streaming (SSE)"
        if driver == "http"
        else "gRPC straight to the scheduler's Generate (no gateway)"
    )
    notes = []
    if plan.device and plan.device.startswith("emulated:"):
        notes.append(
            f"--device {plan.device}: every stage's forward pass is a wait of the profile's modelled "
            "step time (no compute); the control plane is real. Not a measurement of any accelerator."
        )
    if plan.quick:
        notes.append(
            f"--quick: `long` generates {plan.shape.long_output} tokens (not 512) and `shared-prefix` "
            f"{plan.shape.shared_output}; {plan.duration_s:.0f} s of load fix each comparison's request count."
        )
    notes.append(
        f"(e) runs chunked prefill on with max_num_batched_tokens={plan.chunked_budget} against off with "
        "the default 2048 (off needs a budget that holds the longest prompt)."
    )
    notes.append(
        "(d) drives the in-process engine from this process with no HTTP or gRPC; the full stack is "
        f"driven over {driver}."
    )
    return {
        "meta": {
            "command": "pagoda bench " + shlex.join(sys.argv[1:]),
            "machine": machine_info(),
            "started": started,
            "elapsed_s": time.perf_counter() - t0,
            "load_average_start": load_start,
            "load_average_end": load_average(),
            "driver": driver,
            "driver_note": driver_note,
            "total_threads": plan.total_threads,
            "quick": plan.quick,
            "notes": notes,
            "device": plan.device or "cpu",
        },
        "plan": json.loads(json.dumps(dataclasses.asdict(plan), default=str)),
        "models": [m.to_dict() for m in models],
    }


def _report(results: dict, args: argparse.Namespace, log) -> int:
    """Write the results and print the comparisons; 3 when a comparison failed a check."""
    from bench.report import comparison_rows

    _write(results, args.out, args.plot, log)
    log("")
    log("\n".join(comparison_rows(results)))
    log(f"\npagoda bench: done in {results['meta']['elapsed_s']:.0f} s")
    failed = [c for m in results["models"] for c in m["comparisons"] if not c["ok"]]
    if failed:
        print(f"pagoda bench: {len(failed)} comparison(s) failed a check (see results.md)", file=sys.stderr)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    """`pagoda bench ...` (which runs `python -m bench.cli ...`)."""
    p = argparse.ArgumentParser(prog="pagoda bench", description=__doc__.split("\n\n")[0])
    add_bench_arguments(p)
    return run_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
