"""Runs a benchmark plan: for each model, the arms its comparisons need, then the comparisons.

Per model, in this order (each stack started once and stopped before the next, so arms never
share the cores):

 0. when (f) is on, the stack with prefix caching off: `shared-prefix` closed loop for
    `duration_s`, which fixes how many requests the other arm of (f) runs;
 1. the base stack (PP=1, async, chunked prefill and prefix caching on) through the gateway:
    `mixed` closed loop for `duration_s` (this fixes how many requests every other arm runs),
    the concurrency sweep and the open-loop (Poisson) runs, then `shared-prefix` (f);
 2. one stack per other arm: sync scheduling (b), PP=2 (c; also the Gantt run),
    chunked prefill on with a small budget and off (e);
 3. the in-process engine (d) and the transformers baseline (a) in this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.arms import EngineSettings, InProcessArm, StackArm, cpu_count
from bench.compare import COMPARISON_KEYS, COMPARISONS, RunResult, compare
from bench.load import LoadResult, closed_loop, open_loop
from bench.machine import cpu_sample, foreign_cpu
from bench.stats import client_metrics, quantiles_ms, service_metrics
from bench.workloads import QUICK_SHAPE, Shape, TokenSpace, Workload, make_workload, num_output_tokens


@dataclass(frozen=True)
class ModelPlan:
    preset: str
    comparisons: tuple[str, ...]
    num_kv_blocks: int = 2048
    sweep: tuple[int, ...] = ()
    open_loop_loads: tuple[float, ...] = ()


@dataclass(frozen=True)
class Plan:
    models: tuple[ModelPlan, ...]
    quick: bool = True
    shape: Shape = QUICK_SHAPE
    concurrency: int = 16
    duration_s: float = 20.0
    sweep_duration_s: float = 6.0
    open_loop_duration_s: float = 10.0
    total_threads: int = 2
    chunked_budget: int = 64
    gantt_s: float = 3.0
    seed: int = 0
    driver: str = "http"
    device: str | None = None  # every stack arm's stages' --device ("emulated:PROFILE"); None: the server's

    def __post_init__(self) -> None:
        for m in self.models:
            unknown = set(m.comparisons) - set(COMPARISON_KEYS)
            if unknown:
                raise ValueError(f"comparisons: unknown {sorted(unknown)}; known: {', '.join(COMPARISON_KEYS)}")
        if self.concurrency < 1 or self.duration_s <= 0 or self.total_threads < 1:
            raise ValueError("concurrency, duration_s and total_threads must be positive")
        if any("c" in m.comparisons for m in self.models) and self.total_threads % 2:
            raise ValueError(
                f"threads: (c) gives PP=1 and PP=2 the same total, so it must be even, got {self.total_threads}"
            )


@dataclass
class ModelResults:
    preset: str
    model_dir: str
    num_parameters: int
    runs: list[RunResult] = field(default_factory=list)
    comparisons: list = field(default_factory=list)
    gantt: dict | None = None
    notes: list[str] = field(default_factory=list)

    def run(self, workload: str, arm: str, mode: str = "closed") -> RunResult | None:
        for r in self.runs:
            if (
                r.workload == workload
                and r.arm == arm
                and r.mode in (mode, "static-batch")
                and not r.extra.get("sweep")
            ):
                return r
        return None

    def to_dict(self) -> dict:
        return {
            "preset": self.preset,
            "model_dir": self.model_dir,
            "num_parameters": self.num_parameters,
            "runs": [r.to_dict() for r in self.runs],
            "comparisons": [c.to_dict() for c in self.comparisons],
            "gantt": self.gantt,
            "notes": self.notes,
        }


Log = Callable[[str], None]


class Runner:
    def __init__(self, plan: Plan, log: Log = print, log_dir: Path | None = None) -> None:
        self.plan = plan
        self.log = log
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pagoda-bench-logs-"))

    # --- one run ---------------------------------------------------------------------------

    async def _measure(
        self,
        arm,
        model: str,
        workload: str,
        arm_name: str,
        requests,
        *,
        duration_s: float | None = None,
        rate: float | None = None,
        concurrency: int | None = None,
        extra: dict | None = None,
    ) -> RunResult:
        concurrency = concurrency or self.plan.concurrency
        extra = {**(extra or {}), "load_average_1m": _load_1m()}
        cpu_before = cpu_sample(arm.pids())
        start = await arm.snapshot()
        loaded = {}

        async def at_last_send() -> None:
            loaded["s"] = await arm.snapshot()

        if rate is None:
            res = await closed_loop(arm.client, requests, concurrency, duration_s, at_last_send)
        else:
            res = await open_loop(arm.client, requests, rate, self.plan.seed, at_last_send)
        end = await arm.snapshot()
        extra["foreign_cpu"] = foreign_cpu(cpu_before, cpu_sample(arm.pids()), cpu_count())
        sent = [requests[r.index] for r in res.records]
        return self._result(model, workload, arm_name, arm, res, sent, service_metrics(start, loaded["s"], end), extra)

    def _result(self, model, workload, arm_name, arm, res: LoadResult, sent, services, extra) -> RunResult:
        metrics = client_metrics(res.records, res.duration_s)
        settings = getattr(arm, "settings", None)
        extra = dict(extra)
        ok = [r for r in res.records if r.ok]
        extra["quantiles"] = {
            "ttft_ms": quantiles_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
            "itl_ms": quantiles_ms([x for r in ok for x in r.itls_s]),
        }
        if settings is not None:
            extra.setdefault("threads_per_stage", settings.threads_per_stage)
            extra.setdefault("total_threads", settings.total_threads)
            extra.setdefault("device", settings.device_label)
        r = RunResult(
            model=model,
            workload=workload,
            arm=arm_name,
            settings=settings.describe() if settings is not None else extra.get("settings", ""),
            driver=getattr(arm, "driver", "transformers"),
            mode=res.mode,
            num_requests=len(sent),
            expected_output_tokens=num_output_tokens(sent),
            client=metrics,
            services=services,
            concurrency=res.concurrency,
            rate=res.rate,
            startup_s=getattr(arm, "startup_s", None),
            extra=extra,
        )
        c = r.client
        self.log(
            f"  {r.name:<34} {r.mode:<6} {c.num_requests:>4} req {c.duration_s:6.1f} s "
            f"{c.requests_per_s:7.2f} req/s {c.output_tokens_per_s:8.1f} tok/s "
            f"TTFT p50 {_ms(c.ttft.p50_ms)} ITL p99 {_ms(c.itl.p99_ms)}"
            + (f"  ({c.num_failed} FAILED)" if c.num_failed else "")
        )
        return r

    async def _warm_up(self, arm, space: TokenSpace) -> None:
        """Untimed: prefills and batched decodes once through every path (other prompts)."""
        shape = dataclasses.replace(self.plan.shape, long_output=min(8, self.plan.shape.long_output))
        warm = make_workload("mixed", 2 * self.plan.concurrency, space, shape, seed=self.plan.seed + 1)
        await closed_loop(arm.client, warm, self.plan.concurrency)

    # --- one model -------------------------------------------------------------------------

    async def run_model(self, mp: ModelPlan, model_dir: str, space: TokenSpace, num_parameters: int) -> ModelResults:
        plan, out = self.plan, ModelResults(mp.preset, model_dir, num_parameters)
        comps = set(mp.comparisons)
        base = EngineSettings(total_threads=plan.total_threads, num_kv_blocks=mp.num_kv_blocks, device=plan.device)
        n_shared = 0
        if "f" in comps:
            n_shared = await self._prefix_off_stack(mp, model_dir, space, base, out)
        n_mixed = await self._base_stack(mp, model_dir, space, base, out, n_shared)
        mixed_fixed = Workload("mixed", space, plan.shape, plan.seed, limit=n_mixed)
        for key, name, settings in self._other_stacks(comps, base):
            self.log(f"[{mp.preset}] {name} stack: {settings.describe()}")
            async with self._stack(mp, model_dir, name, settings) as arm:
                await self._warm_up(arm, space)
                out.runs.append(await self._measure(arm, mp.preset, COMPARISONS[key].workload, name, mixed_fixed))
                if name == "pp2" and plan.gantt_s > 0 and mp is plan.models[0]:
                    out.gantt = await self._gantt(arm, space)
        if "d" in comps:
            self.log(f"[{mp.preset}] in-process engine: {base.describe()}")
            async with InProcessArm(model_dir, base) as arm:
                await self._warm_up(arm, space)
                out.runs.append(await self._measure(arm, mp.preset, "mixed", "in-process", mixed_fixed))
        if "a" in comps:
            out.runs.append(await self._transformers(mp, model_dir, mixed_fixed))
        self._compare(mp, base, out)
        return out

    def _stack(self, mp: ModelPlan, model_dir: str, name: str, settings: EngineSettings) -> StackArm:
        return StackArm(model_dir, settings, self.log_dir / mp.preset / name, self.plan.driver, self.plan.concurrency)

    async def _prefix_off_stack(
        self, mp: ModelPlan, model_dir: str, space: TokenSpace, base: EngineSettings, out: ModelResults
    ) -> int:
        """(f)'s slow arm, prefix caching off: `shared-prefix` for duration_s; its request count.

        Its 20 s fix the count, so that the fast arm, not the slow one, is the one that
        finishes early."""
        shared = Workload("shared-prefix", space, self.plan.shape, self.plan.seed)
        settings = base.with_(enable_prefix_caching=False)
        self.log(f"[{mp.preset}] prefix-off stack: {settings.describe()}")
        async with self._stack(mp, model_dir, "prefix-off", settings) as arm:
            await self._warm_up(arm, space)
            r = await self._measure(
                arm, mp.preset, "shared-prefix", "prefix-off", shared, duration_s=self.plan.duration_s
            )
            out.runs.append(r)
        return r.num_requests

    async def _base_stack(
        self, mp: ModelPlan, model_dir: str, space: TokenSpace, base: EngineSettings, out: ModelResults, n_shared: int
    ) -> int:
        """The base arm: `mixed` for duration_s (its request count, returned, fixes every other
        arm's), the concurrency sweep, the open-loop runs, (f)'s `shared-prefix` run of
        `n_shared` requests, and the Gantt run when no PP=2 arm makes it."""
        plan, comps = self.plan, set(mp.comparisons)
        mixed = Workload("mixed", space, plan.shape, plan.seed)
        self.log(f"[{mp.preset}] base stack: {base.describe()}")
        async with self._stack(mp, model_dir, "pagoda", base) as arm:
            await self._warm_up(arm, space)
            r = await self._measure(arm, mp.preset, "mixed", "pagoda", mixed, duration_s=plan.duration_s)
            out.runs.append(r)
            await self._sweep_and_open_loop(arm, mp, space, mixed, r.client.requests_per_s, out)
            if "f" in comps:
                shared_fixed = Workload("shared-prefix", space, plan.shape, plan.seed, limit=n_shared)
                out.runs.append(await self._measure(arm, mp.preset, "shared-prefix", "pagoda", shared_fixed))
            if "c" not in comps and plan.gantt_s > 0 and out.gantt is None and mp is plan.models[0]:
                out.gantt = await self._gantt(arm, space)
        return r.num_requests

    async def _sweep_and_open_loop(
        self, arm, mp: ModelPlan, space: TokenSpace, mixed: Workload, requests_per_s: float, out: ModelResults
    ) -> None:
        """On the base stack: closed loops at the sweep's other concurrencies, then Poisson
        arrivals at each load, a fraction of the closed loop's `requests_per_s`."""
        plan = self.plan
        for c in mp.sweep:
            if c == plan.concurrency:
                continue
            out.runs.append(
                await self._measure(
                    arm,
                    mp.preset,
                    "mixed",
                    "pagoda",
                    mixed,
                    concurrency=c,
                    duration_s=plan.sweep_duration_s,
                    extra={"sweep": True},
                )
            )
        for load in mp.open_loop_loads:
            rate = load * requests_per_s
            n = max(1, math.ceil(rate * plan.open_loop_duration_s))
            requests = Workload("mixed", space, plan.shape, plan.seed + 7, limit=n)
            out.runs.append(
                await self._measure(
                    arm, mp.preset, "mixed", f"pagoda@{load:.0%}", requests, rate=rate, extra={"load": load}
                )
            )

    def _other_stacks(self, comps: set[str], base: EngineSettings) -> list[tuple[str, str, EngineSettings]]:
        """(comparison, arm name, settings) of each stack besides the base one and prefix-off."""
        other_arms: list[tuple[str, str, EngineSettings]] = []
        if "b" in comps:
            # the base arm runs the default (async): (b) measures the other mode against it
            other = not base.is_async
            other_arms.append(("b", "async" if other else "sync", base.with_(async_scheduling=other)))
        if "c" in comps:
            other_arms.append(("c", "pp2", base.with_(pipeline_parallel_size=2)))
        if "e" in comps:
            budget = self.plan.chunked_budget
            other_arms.append(("e", "chunked-on", base.with_(max_num_batched_tokens=budget)))
            other_arms.append(("e", "chunked-off", base.with_(enable_chunked_prefill=False)))
        return other_arms

    def _compare(self, mp: ModelPlan, base: EngineSettings, out: ModelResults) -> None:
        """Each of the model's comparisons, in its order, over the runs of its two arms."""
        for key in mp.comparisons:
            spec = COMPARISONS[key]
            if key == "b" and base.is_async:  # the base arm is the async one: sync is the other
                spec = replace(spec, arm="pagoda", baseline="sync")
            a, b = out.run(spec.workload, spec.arm), out.run(spec.workload, spec.baseline)
            if a is None or b is None:
                out.notes.append(f"({key}) not compared: an arm is missing")
                continue
            out.comparisons.append(compare(spec, a, b))

    async def _transformers(self, mp: ModelPlan, model_dir: str, requests) -> RunResult:
        from bench.baseline import run_transformers

        self.log(
            f"[{mp.preset}] transformers static batching, batch {self.plan.concurrency}, "
            f"{self.plan.total_threads} torch thread(s)"
        )
        sent = [requests[i] for i in range(len(requests))]
        load = _load_1m()
        cpu_before = cpu_sample([os.getpid()])
        res, info = await asyncio.to_thread(
            run_transformers, model_dir, sent, self.plan.concurrency, self.plan.total_threads
        )
        extra = {
            **asdict(info),
            "settings": f"transformers {info.transformers_version} generate(), "
            f"static batches of {info.batch_size}, {info.torch_threads} torch thread(s)",
            "load_average_1m": load,
            "foreign_cpu": foreign_cpu(cpu_before, cpu_sample([os.getpid()]), cpu_count()),
        }

        class _Arm:  # what _result reads of an arm
            driver, startup_s = "transformers", info.load_s

        return self._result(mp.preset, "mixed", "transformers", _Arm(), res, sent, None, extra)

    async def _gantt(self, arm: StackArm, space: TokenSpace) -> dict:
        """A few seconds of `mixed` load with `debug_timeline` on every request, straight to the
        scheduler: the union of the requests' timelines is every micro-batch's time on every stage."""
        from bench.clients import SchedulerClient

        client = SchedulerClient(arm.stack.scheduler_address, debug_timeline=True)
        try:
            requests = Workload("mixed", space, self.plan.shape, self.plan.seed + 11)
            t0_ns = time.time_ns()
            await closed_loop(client, requests, self.plan.concurrency, self.plan.gantt_s)
        finally:
            await client.close()
        steps: dict[tuple[int, int], dict] = {}
        for e in client.timeline_events:
            if e.category != "stage" or not e.HasField("stage_index") or not e.HasField("micro_batch_id"):
                continue
            steps[(e.stage_index, e.micro_batch_id)] = {
                "stage": e.stage_index,
                "micro_batch_id": e.micro_batch_id,
                "start_ns": e.start_ns,
                "end_ns": e.end_ns,
            }
        events = sorted(steps.values(), key=lambda s: (s["start_ns"], s["stage"]))
        self.log(f"  gantt: {len(events)} stage steps from {len(client.timeline_events)} timeline events")
        return {
            "settings": arm.settings.describe(),
            "t0_ns": t0_ns,
            "events": events,
            "source": "debug_timeline of every request (stage compute per micro-batch)",
        }

    # --- everything --------------------------------------------------------------------------

    async def run(self, prepare_model: Callable[[str], tuple[str, TokenSpace, int]]) -> list[ModelResults]:
        results = []
        for mp in self.plan.models:
            model_dir, space, params = prepare_model(mp.preset)
            results.append(await self.run_model(mp, model_dir, space, params))
        return results


def _load_1m() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _ms(v: float | None) -> str:
    return f"{v:7.1f} ms" if v is not None else "      - ms"
