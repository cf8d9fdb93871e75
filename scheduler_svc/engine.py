"""The scheduler's event loop: requests in, micro-batches out, results back, failures handled.

One asyncio task owns the planner. It reacts to events — a request arrives or is aborted,
a micro-batch result or error comes back, a stage goes down — and plans the next
micro-batch while others execute (`async_scheduling`), so no stage waits on planning, on
the KV service's round trip or on the network. With `async_scheduling=False` it plans,
runs, waits and repeats, for comparison.

Transports carry micro-batches to the stages: over gRPC (`scheduler_svc.transport`) or to
in-process stage runners (`wiring.local_engine`); the KV client is in-process or gRPC.
The scheduling code is the same for all of them.

What is recorded about the work (metrics, spans, per-request timelines, the scheduler trace
file, the GetStats counts) is the `EngineObserver`'s (`scheduler_svc.observer`): the engine
calls it at the points where things happen and carries none of it in its own flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.deadlines import StepDeadlines
from scheduler_svc.core.lora import LoraRegistry
from scheduler_svc.core.planner import Planner, PlannerConfig, SeqUpdate
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import FinishReason, Request, RequestState
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.observer import EngineObserver, Outcome
from services.admission import Limits, admit, admit_pooling
from services.kv_layout import entries_that_fit, parse_spec
from services.kv_types import StepOutput
from services.pooling import Embedding
from services.step import StepPlan, StepResult

log = logging.getLogger(__name__)
_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11's timeout context; None on 3.10
_NO_KV_CHANGES = StepOutput(results={}, copies=())
# how long the stages have to answer whether they work on a late step (a throttled process
# answers late too; one that does not answer in this long is taken for hung)
PROGRESS_ASK_TIMEOUT_S = 5.0
# a stage computing a step is working while its last tick (one a layer) is younger than the
# step timeout or this, whichever is longer: one layer of a large step on a throttled CPU can
# take seconds; a stage that does not answer at all is hung at once
PROGRESS_MIN_AGE_S = 30.0


def admission_limits(config: SchedulerConfig, vocab_size: int) -> Limits:
    """What the scheduler admits a request against (`services.admission`), at its edge and in
    `Engine.submit`: the context, the model's vocabulary (0 until a stage reports it: not
    checked), max_num_seqs choices, the KV pool."""
    return Limits(max_model_len=config.max_model_len, vocab_size=vocab_size, max_n=config.max_num_seqs,
                  num_kv_blocks=kv_entries(config), block_size=config.block_size)


def kv_entries(config: SchedulerConfig) -> int:
    """The KV pool in block positions one sequence can hold (with KV groups, pages are
    shared out among the sub-groups: services/kv_layout.py); 0 when not known yet."""
    pages = config.num_kv_blocks or 0
    if not pages or not config.kv_groups:
        return pages
    return entries_that_fit(pages, parse_spec(config.kv_groups), config.block_size, config.max_num_batched_tokens)


# --- what transports report -----------------------------------------------------------


@dataclass(frozen=True)
class StageInfo:
    """A stage as it reported itself (LoadInfo) when its event stream opened."""

    stage_index: int
    num_stages: int
    epoch: int
    layer_start: int
    layer_end: int
    num_layers: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    address: str = ""
    # the first stage gets each sampled token straight from the last (several stages): the
    # plans carry no tokens and placeholder steps work at any pipeline size
    feedback: bool = False
    weights_bytes: int = 0  # the stage's weights as held (packed formats at their packed size)
    expert_weights_bytes: int = 0  # of those, the experts of mixture-of-experts layers
    quantization: str = ""  # its weight format when not plain ("fp8", "gguf:Q4_1/Q8_0", ...)
    kv_block_bytes: int = 0  # one KV block over the stage's layers, at its pools' dtype
    kv_cache_dtype: int = 0  # the pools' dtype (common_pb2.DType)
    memory_budget_bytes: int = 0  # the memory setting's budget when the pool was sized from one
    kv_groups: str = ""  # its KV layout's sub-group windows (services/kv_layout.py), "" for one table
    device: str = ""  # "cpu", "cuda:0", or "emulated:PROFILE" (its compute a modelled wait)
    cpu: str = ""  # on the CPU: its model, ISA level and the path each product takes


@dataclass(frozen=True)
class ErrorEvent:
    micro_batch_id: int
    stage_index: int
    code: str  # a grpc.StatusCode name
    message: str


@dataclass(frozen=True)
class ProgressReport:
    """The stages' answer about a step past its deadline: `working` when every stage
    answered and each one computing ticked within the base timeout."""

    micro_batch_id: int
    working: bool
    detail: str
    computing: tuple[int, ...] = ()  # the micro-batches the stages said they compute


@dataclass(frozen=True)
class StageDownEvent:
    stage_index: int
    message: str


class StageTransport(Protocol):
    """Carries micro-batches down the pipeline and reports results as events."""

    async def connect(self, on_event: Callable[[object], None], timeout_s: float) -> list[StageInfo]:
        """(Re)connect to every stage; returns their LoadInfo once all are ready."""

    async def submit(self, plan: StepPlan) -> None:
        """Send a step down the pipeline; its StepResult (or ErrorEvent) comes back as an event."""

    async def abandon(self, seq_ids: list[int]) -> None:
        """With feedback: tell the first stage these sequences' awaited tokens will not come."""

    async def stage_stats(self, timeout_s: float = 1.0) -> list[dict]: ...

    async def close(self) -> None: ...


class KVClient(Protocol):
    async def step(self, step_input) -> StepOutput: ...

    async def reset(self) -> None: ...

    async def stats(self): ...


# --- what clients receive -------------------------------------------------------------


@dataclass
class ChoiceDelta:
    index: int
    token_ids: list[int]
    logprobs: list
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None


@dataclass
class RequestOutput:
    request_id: str
    deltas: list[ChoiceDelta]
    finished: bool = False
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: tuple[str, str] | None = None  # (grpc status name, message)
    timeline: list[dict] = field(default_factory=list)
    # on the request's first output, when prompt_logprobs was asked: per prompt token after
    # the first, (token id, logprob, rank, [(id, logprob) most likely first])
    prompt_logprobs: list | None = None
    # on a pooling request's last output, when it finished: its pooled vector
    embedding: Embedding | None = None


@dataclass
class _Live:
    request: Request
    outputs: asyncio.Queue
    failures: int = 0  # micro-batches of it that failed on a stage


class Engine:
    """Owns a Planner; one asyncio task runs the loop."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVClient,
        transport: StageTransport,
        eos_token_ids: tuple[int, ...] = (),
        clock: Callable[[], float] = time.monotonic,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.config = config
        # micro-batches in flight: when each is late enough to ask the stages whether they work
        self._deadlines = StepDeadlines(config.step_timeout_s, config.max_num_batched_tokens)
        self._asking = False  # the stages are being asked about a late step
        self.kv = kv
        self.transport = transport
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        queue = WaitingQueue(
            config.scheduler_policy, config.tenant_weights, aging_rate=config.aging_rate,
            max_len=config.max_queue_len,
        )
        self.planner = Planner(
            PlannerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_in_flight=config.max_in_flight,
                pipeline_parallel_size=config.pipeline_parallel_size,
                microbatch_size=config.microbatch_size,
                max_model_len=config.max_model_len,
                namespace=config.model or None,
                block_size=config.block_size,
                async_decode=config.is_async,
                **_speculation(config),
            ),
            queue,
        )
        self.observer = EngineObserver(self.planner, metrics or SchedulerMetrics(config.model), clock,
                                       config.trace_file, prefix_caching=config.enable_prefix_caching)
        self.stages: list[StageInfo] = []
        self.loras = LoraRegistry()  # the LoRA adapters the stages serve (core/lora.py)
        self.healthy = False
        self.health_detail = "starting"
        self._live: dict[str, _Live] = {}
        # None (a wake-up) or (generation, event) from the stage connection of that generation
        self._events: asyncio.Queue = asyncio.Queue()
        self._generation = 0  # of the stage connection: one more for each connect attempt
        self._task: asyncio.Task | None = None
        self._side_tasks: set[asyncio.Task] = set()
        self._unhealthy_since: float | None = None
        self.started_s = clock()
        self._stopping = False

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        # A scheduler starts owning nothing: whatever the KV service and the stages hold
        # belongs to a scheduler before it (one that died), so it is released now, not
        # when a collision forces it (docs/architecture.md, "What a restart guarantees").
        for attempt in range(60):  # the KV service may still be starting
            try:
                dropped = await self.kv.reset()
                break
            except Exception:  # noqa: BLE001 - unavailable yet: retried, then raised
                if attempt == 59:
                    raise
                await asyncio.sleep(0.5)
        if dropped:
            log.warning("released %d sequences a previous scheduler left in the KV service", dropped)
        self.planner.reset_all(self.clock())  # the first plan tells the stages to drop theirs
        await self._connect()
        self._task = asyncio.create_task(self._loop(), name="scheduler-loop")

    async def stop(self) -> None:
        if self._task is not None:
            # the flag ends the loop even where a cancellation is lost: Python 3.11's
            # asyncio.wait_for returns a result that arrived as it was cancelled, swallowing
            # the cancellation (seen: stop() waiting for ever after an abort's wake-up)
            self._stopping = True
            self._task.cancel()
            self._wake()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for live in list(self._live.values()):
            self._finish(live, None, "error", ("UNAVAILABLE", "the scheduler is shutting down"))
        await self.transport.close()
        self.observer.close()

    async def _connect(self) -> None:
        # events are tagged with the attempt they come from: a later attempt makes them stale
        self._generation += 1
        generation = self._generation

        def on_event(event: object) -> None:
            self._events.put_nowait((generation, event))

        stages = await self.transport.connect(on_event, timeout_s=30.0)
        sync = getattr(self.transport, "sync_loras", None)
        if sync is not None:  # (a restarted stage holds only the adapters of --lora-modules)
            for name in await sync(self.loras):
                self.end_lora_requests(name, f"model: the LoRA adapter {name!r} could not be loaded again "
                                             "on a restarted stage, and was unloaded")
        self.stages = stages
        self._check_capacity()
        self.planner.set_feedback(self.stages[0].feedback)
        self.healthy = True
        self.health_detail = "serving"
        self._unhealthy_since = None

    def _check_capacity(self) -> None:
        """One source of capacity: every stage must agree with the KV service and the config."""
        cfg = self.config
        for info in self.stages:
            # a stage may hold more blocks than the pool uses (pools sized from memory: the
            # smallest stage's is the pool), never fewer
            if info.block_size != cfg.block_size or (
                cfg.num_kv_blocks is not None and info.num_kv_blocks < cfg.num_kv_blocks
            ):
                raise ValueError(
                    f"stage {info.stage_index} has {info.num_kv_blocks} KV blocks of {info.block_size}; "
                    f"the scheduler and KV service use {cfg.num_kv_blocks} of {cfg.block_size}"
                )
            if info.num_stages != len(self.stages):
                raise ValueError(f"stage {info.stage_index} was started as one of {info.num_stages} stages")
            if parse_spec(info.kv_groups) != parse_spec(cfg.kv_groups):
                raise ValueError(f"stage {info.stage_index} keeps KV groups {info.kv_groups or 'none'} "
                                 f"(services/kv_layout.py), the KV service {cfg.kv_groups or 'none'}")

    def _background(self, coro) -> None:
        """Run a call to a service without waiting for it; a failure is logged (the events
        stream reports a stage that is gone)."""
        task = asyncio.create_task(coro)
        self._side_tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._side_tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("%s", t.exception())

        task.add_done_callback(done)

    @property
    def _max_in_flight(self) -> int:
        """Steps in the pipeline at once: with placeholder steps (asynchronous, one stage or a
        feedback stream) each stage's micro-batch has its next step queued behind it."""
        cfg = self.config
        if cfg.is_async and (cfg.pipeline_parallel_size == 1 or self.planner.feedback):
            return 2 * cfg.pipeline_parallel_size
        return cfg.max_in_flight

    @property
    def vocab_size(self) -> int:
        return self.stages[-1].vocab_size if self.stages else 0

    # --- what the observer records, as the server and the benchmarks read it ---------------

    @property
    def metrics(self) -> SchedulerMetrics:
        return self.observer.metrics

    @metrics.setter
    def metrics(self, metrics: SchedulerMetrics) -> None:
        self.observer.metrics = metrics

    @property
    def recent_spans(self) -> deque[tuple[int, int, int, int]]:
        """(stage index, micro-batch id, compute start ns, end ns) of the last steps."""
        return self.observer.recent_spans

    @property
    def active_ns(self) -> int:
        """Wall time with at least one live request: the stages' chance to work."""
        return self.observer.active_ns

    @property
    def num_micro_batches(self) -> int:
        return self.observer.num_micro_batches

    @property
    def num_recoveries(self) -> int:
        return self.observer.num_recoveries

    # --- the public surface ----------------------------------------------------------------

    def submit(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue a request; iterate the result for its outputs. Raises QueueFull, ValueError."""
        request.eos_token_ids = request.eos_token_ids or self.eos_token_ids
        request.arrival_s = self.clock()
        if request.request_id in self._live:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.lora_name:  # AdapterNotServed (a LookupError) unless served now
            request.lora_load_id = self.loras.admit(request.lora_name).load_id
        self._fit_to_context(request)
        displaced = self.planner.add(request)  # QueueFull propagates, nothing changed
        if displaced is not None:
            gone = self._live.pop(displaced.request_id, None)
            if gone is not None:
                self._finish(gone, "abort", "displaced", (
                    "RESOURCE_EXHAUSTED",
                    "the waiting queue is full: this request gave its place to a more urgent one; retry later"))
        self.update_active_time()  # the time before this arrival counts as idle if nothing was live
        live = _Live(request, asyncio.Queue())
        self._live[request.request_id] = live
        self.observer.request_admitted(request)
        self._wake()
        return self._outputs(live)

    def _fit_to_context(self, request: Request) -> None:
        """Admit the request's options (`services.admission`, as the server does at its edge),
        resolving max_tokens to the context it has; AdmissionError (a ValueError) if it could
        never run."""
        check = admit if request.pooling is None else admit_pooling
        request.options = check(request.options, admission_limits(self.config, self.vocab_size),
                                len(request.prompt))

    async def _outputs(self, live: _Live) -> AsyncIterator[RequestOutput]:
        try:
            held: RequestOutput | None = None
            while True:
                out, held = (held, None) if held is not None else (await live.outputs.get(), None)
                # a consumer that fell behind gets the steps it missed as one output, not one
                # message per token (an error goes out on its own, after the tokens before it)
                while not out.finished and not live.outputs.empty():
                    later = live.outputs.get_nowait()
                    if later.error is not None:
                        held = later
                        break
                    out = _merge(out, later)
                yield out
                if out.finished:
                    return
        finally:
            # the consumer went away (client cancelled): abort what is still running
            if live.request.state.is_live:
                self.abort(live.request.request_id)

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Abort a request, or with `index` end just that choice (a stop string matched at the
        gateway: counted as a stop, as the gateway counts it)."""
        live = self._live.get(request_id)
        if live is None:
            return False
        if index is not None and live.request.options.n > 1:
            if self.planner.finish_choice(request_id, index, self.clock()) is not None:
                self._live.pop(request_id, None)
                self._finish(live, "stop", "finished")
            self._wake()
            return True
        request = self.planner.abort(request_id, self.clock())
        self._live.pop(request_id, None)
        if request is None:
            self.observer.request_forgotten(request_id)
        elif index is not None:  # the one choice of a request ended at the gateway
            self._finish(live, "stop", "finished")
        else:
            self._finish(live, "abort", "aborted")
        self._wake()
        return request is not None

    def lora_busy(self, name: str) -> bool:
        """Whether a request runs (or waits) under LoRA adapter `name`, or a step in flight
        holds one of its sequences (an ended one's last step included)."""
        planner = self.planner
        return (any(r.lora_name == name for r in planner.requests.values())
                or any(s.seq.request.lora_name == name for mb in planner.in_flight.values() for s in mb.seqs))

    def end_lora_requests(self, name: str, message: str) -> int:
        """End every request under LoRA adapter `name` with NOT_FOUND `message` (the adapter
        is gone); returns how many."""
        ended = [live for live in self._live.values() if live.request.lora_name == name]
        for live in ended:
            self.planner.abort(live.request.request_id, self.clock())
            self._live.pop(live.request.request_id, None)
            self._finish(live, "error", "error", ("NOT_FOUND", message))
        self._wake()
        return len(ended)

    def _wake(self) -> None:
        self._events.put_nowait(None)

    # --- the loop ----------------------------------------------------------------------------

    def update_active_time(self) -> None:
        self.observer.mark_time(busy=bool(self._live))

    async def _loop(self) -> None:
        timeout = self.config.scheduler_timeout_ms / 1000
        while not self._stopping:
            self.update_active_time()
            try:
                await self._dispatch()
                self._handle(await self._next_event(timeout))
                while not self._events.empty():
                    self._handle(self._events.get_nowait())
                self._check_step_deadline()
                if not self.healthy:
                    await self._recover()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: log it and keep serving what can be served
                log.exception("scheduler loop error")
                await asyncio.sleep(timeout)

    async def _next_event(self, timeout: float) -> tuple[int, object] | None:
        """The next event, or None after `timeout` seconds without one. One that is queued
        already is taken at once; otherwise the wait costs a timer, not a task (as
        asyncio.wait_for's would, once per event: a measurable share of the loop's CPU)."""
        events = self._events
        if not events.empty():
            return events.get_nowait()
        try:
            if _TIMEOUT is None:  # (Python 3.10)
                return await asyncio.wait_for(events.get(), timeout)
            async with _TIMEOUT(timeout):
                return await events.get()
        except (TimeoutError, asyncio.TimeoutError):
            return None

    def _check_step_deadline(self) -> None:
        """A step past its deadline (scaled to its planned work) makes the engine ask the
        stages whether they are still working (their compute loops tick per layer): a slow
        step is waited for, a stage that neither answers nor ticks (SIGSTOP, a livelock) is
        hung, and the pipeline is failed and recovered as after a crash. Either way no
        later step is planned at the late one's size (core/deadlines.py)."""
        if not self.healthy or self._asking:
            return
        overdue = self._deadlines.overdue(time.monotonic())
        if overdue is None:
            return
        self._asking = True
        self._background(self._ask_progress(overdue[0], self._generation))

    async def _ask_progress(self, mb_id: int, generation: int) -> None:
        try:
            stats = await self.transport.stage_stats(timeout_s=PROGRESS_ASK_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - an unanswered question: not working
            stats = [{"stage_index": -1, "healthy": False, "error": str(exc)}]
        working, detail, computing = progress_verdict(stats, self.config.step_timeout_s)
        self._events.put_nowait((generation, ProgressReport(mb_id, working, detail, computing)))

    def _on_progress(self, report: ProgressReport) -> None:
        self._asking = False
        mb_id = report.micro_batch_id
        size = self._deadlines.num_tokens(mb_id)
        if size is None or mb_id not in self.planner.in_flight or not self.healthy:
            return  # it came back (or everything was reset) meanwhile
        blamed = {i: self._deadlines.num_tokens(i) for i in
                  self._deadlines.late(mb_id, report.working, time.monotonic(), report.computing)}
        cap = self._deadlines.token_cap
        self.planner.cap_step_tokens(cap)
        self.observer.step_late(mb_id, size, report.working, cap, report.detail, blamed)
        if report.working:
            log.warning("micro-batch %d (%d tokens) is past its deadline but its stages are working (%s): "
                        "waiting on; later steps hold at most %d tokens", mb_id, size, report.detail, cap)
            return
        self._fail_requests_of(mb_id, ("DEADLINE_EXCEEDED", f"a step of {size} tokens holding this request did "
                                       f"not finish on a stage that stopped working ({report.detail})"))
        self._mark_unhealthy(f"step deadline: micro-batch {mb_id} ({size} tokens) not finished and its stages "
                             f"not working: {report.detail}: a stage is hung")

    def _fail_requests_of(self, mb_id: int, error: tuple[str, str]) -> None:
        """Each request of a failed step counts a failure (`_count_failures`)."""
        requests = {s.seq.request.request_id for s in self.planner.in_flight[mb_id].seqs}
        self._count_failures(requests, error)

    def _count_failures(self, request_ids, error: tuple[str, str]) -> None:
        """Each request counts a failure; one at `max_request_failures` ends with `error`
        instead of being recomputed again."""
        now = self.clock()
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None:
                continue
            live.failures += 1
            if live.failures >= self.config.max_request_failures:
                self.planner.abort(request_id, now)
                self._live.pop(request_id, None)
                self._finish(live, "error", "error", error)

    async def _dispatch(self) -> None:
        planner = self.planner
        while self.healthy and len(planner.in_flight) < self._max_in_flight:
            if not planner.has_schedulable() and not planner.has_pending_kv_work:
                return
            proposal = planner.propose()
            try:
                # decodes inside their blocks only: no round trip (the KV service catches up later)
                output = _NO_KV_CHANGES if proposal.skips_kv else await self.kv.step(proposal.step_input)
            except Exception as exc:  # the KV service is down (or refused a step: a bug)
                log.error("KV step failed: %s", exc)
                self._mark_unhealthy(f"KV service: {exc}")
                return
            mb = planner.finalize(proposal, output, self.clock())
            self.observer.micro_batch_planned(mb)
            if mb is None:
                return  # nothing fits now (or only housekeeping): a result or an event changes that
            self._deadlines.dispatched(mb.micro_batch_id, mb.num_tokens, time.monotonic())
            try:
                await self.transport.submit(mb.plan)
            except Exception as exc:
                log.error("submitting micro-batch %d failed: %s", mb.micro_batch_id, exc)
                self._mark_unhealthy(f"stage 0: {exc}")

    def _handle(self, item: tuple[int, object] | None) -> None:
        if item is None:  # a wake-up
            return
        generation, event = item
        if isinstance(event, ProgressReport):  # (checked against what is in flight now)
            self._on_progress(event)
            return
        if generation != self._generation:
            return  # from a stage connection that a reconnect replaced
        if isinstance(event, StepResult):
            self._on_result(event)
        elif isinstance(event, ErrorEvent):
            self._on_error(event)
        elif isinstance(event, StageDownEvent):
            self._mark_unhealthy(f"stage {event.stage_index}: {event.message}")

    def _on_result(self, event: StepResult) -> None:
        if event.step_id not in self.planner.in_flight:
            return  # from before a reset
        now = self.clock()
        compute_ns = sum(t.compute_end_ns - t.compute_start_ns for t in event.timings if t.compute_start_ns)
        self._deadlines.returned(event.step_id, time.monotonic(), compute_ns / 1e9 if compute_ns else None)
        updates = self.planner.on_result(event.step_id, event.sampled, now, event.prompt_logprobs, event.pooled,
                                         event.proposals)
        self.observer.micro_batch_returned(event, now)
        self._deliver(updates)

    def _on_error(self, event: ErrorEvent) -> None:
        """A micro-batch failed on a stage: its requests are recomputed, and one that failed
        `max_request_failures` times ends with an error. A stage gone down resets everything."""
        if event.micro_batch_id not in self.planner.in_flight:
            return
        log.warning("micro-batch %d failed on stage %d: %s %s", event.micro_batch_id,
                    event.stage_index, event.code, event.message)
        self._deadlines.forget(event.micro_batch_id)
        # a stage gone, or one whose LoRA adapters are out of step with the registry's (it
        # lost one: FAILED_PRECONDITION): the reconnect puts the adapters right, and no
        # request of the step is failed for it
        if event.code in ("UNAVAILABLE", "FAILED_PRECONDITION"):
            self._mark_unhealthy(f"stage {event.stage_index}: {event.message}")
            return
        if self.planner.feedback:  # no token comes from this step: later steps must not wait
            seq_ids = [s.seq_id for s in self.planner.in_flight[event.micro_batch_id].seqs]
            self._background(self.transport.abandon(seq_ids))
        now = self.clock()
        failed = [r.request_id for r in self.planner.on_failure(event.micro_batch_id, now)]
        self._count_failures(failed, ("INTERNAL", f"stage {event.stage_index}: {event.code} {event.message}"))
        self.observer.micro_batch_failed(event.micro_batch_id)

    def _deliver(self, updates: list[SeqUpdate]) -> None:
        touched: dict[str, list[ChoiceDelta]] = {}
        for u in updates:
            seq = u.seq
            delta = ChoiceDelta(
                seq.index, u.new_token_ids, u.new_logprobs,
                seq.finish_reason if u.finished else None,
                seq.stop_token_id if u.finished else None,
            )
            touched.setdefault(seq.request.request_id, []).append(delta)
            self.observer.tokens_delivered(u)
        for request_id, deltas in touched.items():
            live = self._live.get(request_id)
            if live is None:
                continue
            request = live.request
            if request.state == RequestState.FINISHED:
                self._live.pop(request_id, None)
                reason = request.sequences[0].finish_reason
                out = self._final(live, reason.value if reason else "stop", "finished")
                out.deltas = deltas
                out.embedding = request.embedding
                if request.pooling is not None and request.embedding is None:
                    out.error = ("INTERNAL", "the last stage returned no pooled vector")
            else:
                out = RequestOutput(request_id, deltas)
            if request.options.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                # complete by now: the prompt's last chunk precedes the first sampled token
                out.prompt_logprobs = list(request.prompt_logprobs)
                request.prompt_logprobs_sent = True
            live.outputs.put_nowait(out)

    def _final(self, live: _Live, reason: str | None, outcome: Outcome,
               error: tuple[str, str] | None = None) -> RequestOutput:
        """The request's last output. It ended with `outcome`, counted under finish `reason`
        (None: not counted); an abort ends each choice still going with ABORT."""
        r = live.request
        timeline = self.observer.request_finished(r, reason, outcome)
        deltas = []
        if outcome == "aborted":
            deltas = [ChoiceDelta(s.index, [], [], FinishReason.ABORT) for s in r.sequences
                      if s.finish_reason in (None, FinishReason.ABORT)]
        return RequestOutput(
            r.request_id, deltas, finished=True,
            num_prompt_tokens=len(r.prompt),
            num_completion_tokens=r.num_output_tokens,
            num_cached_tokens=r.num_cached_tokens,
            num_preemptions=r.num_preemptions,
            error=error,
            timeline=timeline,
        )

    def _finish(self, live: _Live, reason: str | None, outcome: Outcome,
                error: tuple[str, str] | None = None) -> None:
        live.outputs.put_nowait(self._final(live, reason, outcome, error))

    # --- failures ------------------------------------------------------------------------

    def _mark_unhealthy(self, detail: str) -> None:
        if self.healthy:
            log.warning("pipeline unhealthy: %s; preempting everything running", detail)
        self.healthy = False
        self.health_detail = detail
        if self._unhealthy_since is None:
            self._unhealthy_since = self.clock()
        hit = self.planner.reset_all(self.clock())
        self._deadlines.clear()
        self.observer.pipeline_reset(detail, hit)

    async def _recover(self) -> None:
        """Wait until the chain and the KV service answer again (new epochs), then continue.

        Events queued meanwhile are handled before anything is dispatched: those of older
        connections and results of reset micro-batches are dropped, but the new connection's
        (a stage that went down again) count, and recovery goes on.
        """
        while not self.healthy:
            waited = self.clock() - (self._unhealthy_since or self.clock())
            if waited > self.config.recovery_timeout_s:
                for live in list(self._live.values()):
                    self.planner.abort(live.request.request_id, self.clock())
                    self._live.pop(live.request.request_id, None)
                    self._finish(live, "error", "error",
                                 ("UNAVAILABLE", f"pipeline unavailable: {self.health_detail}"))
                self._unhealthy_since = self.clock()
            try:
                await self.kv.reset()
                await self._connect()
                log.info("pipeline healthy again (epochs %s)", [s.epoch for s in self.stages])
                self.observer.pipeline_recovered([s.epoch for s in self.stages])
            except Exception as exc:  # not yet
                self.health_detail = f"recovering: {exc}"
                await asyncio.sleep(0.5)
                continue
            while self.healthy and not self._events.empty():
                self._handle(self._events.get_nowait())

    # --- stats --------------------------------------------------------------------------------

    def summary(self) -> dict:
        planner, observer = self.planner, self.observer
        return {
            "num_waiting": len(planner.queue),
            "num_running": len(planner.running),
            "num_preempted": sum(1 for r in planner.queue.ordered() if r.num_preemptions),
            "num_preemptions": planner.num_preemptions,
            "num_in_flight": len(planner.in_flight),
            "queue_by_tenant": planner.queue.depth_by_tenant(),
            "served_tokens_by_tenant": planner.queue.served_tokens_by_tenant(),
            "num_micro_batches": observer.num_micro_batches,
            "num_finished": observer.num_finished,
            "num_aborted": observer.num_aborted,
            "num_prompt_tokens": observer.num_prompt_tokens,
            "num_generated_tokens": observer.num_generated_tokens,
            "healthy": self.healthy,
            "health_detail": self.health_detail,
            "num_late_steps": observer.num_late_steps,
            "step_token_cap": planner.step_token_cap,
            "spec": planner.spec,
        }


def progress_verdict(stats: list[dict], timeout_s: float) -> tuple[bool, str, tuple[int, ...]]:
    """Whether the stages, as `stage_stats` answered, are working on their steps: every one
    answered; each one computing ticked within `timeout_s` (PROGRESS_MIN_AGE_S at the
    least); and when none is computing (a step between stages, or queued), one ticked
    within it. An in-process stage reports no progress: it works while it answers. Returns
    (working, what was seen, the micro-batches being computed)."""
    max_age_s = max(timeout_s, PROGRESS_MIN_AGE_S)
    seen, answered, ids, youngest_s, opaque = [], True, [], None, False
    for st in stats:
        i = st.get("stage_index")
        if not st.get("healthy"):
            seen.append(f"stage {i} did not answer ({st.get('error', '')})")
            answered = False
            continue
        pb = st.get("stats")
        if pb is None or not hasattr(pb, "computing_micro_batch_id"):
            opaque = True
            continue
        age_s = pb.progress_age_ns / 1e9
        youngest_s = age_s if youngest_s is None else min(youngest_s, age_s)
        if pb.computing_micro_batch_id:
            ids.append(pb.computing_micro_batch_id)
            seen.append(f"stage {i} computing micro-batch {pb.computing_micro_batch_id}, "
                        f"last progress {age_s:.1f} s ago")
            answered &= age_s < max_age_s
    if answered and not ids and not opaque:
        seen.append("no stage computing" + ("" if youngest_s is None else f", last progress {youngest_s:.1f} s ago"))
        answered = youngest_s is not None and youngest_s < max_age_s
    return answered, "; ".join(seen) or "no stage answered", tuple(ids)


def _merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: each choice's tokens in order."""
    by_index = {d.index: d for d in first.deltas}
    for d in then.deltas:
        mine = by_index.get(d.index)
        if mine is None:
            first.deltas.append(d)
            by_index[d.index] = d
            continue
        mine.token_ids = mine.token_ids + d.token_ids
        mine.logprobs = mine.logprobs + d.logprobs
        if d.finish_reason is not None:
            mine.finish_reason, mine.stop_token_id = d.finish_reason, d.stop_token_id
    if first.prompt_logprobs is None:
        first.prompt_logprobs = then.prompt_logprobs
    if then.finished:
        first.finished = True
        first.num_prompt_tokens, first.num_completion_tokens = then.num_prompt_tokens, then.num_completion_tokens
        first.num_cached_tokens, first.num_preemptions = then.num_cached_tokens, then.num_preemptions
        first.error, first.timeline, first.embedding = then.error, then.timeline, then.embedding
    return first


def _speculation(config: SchedulerConfig) -> dict:
    """The planner's speculative-decoding settings (none without --speculative-config)."""
    spec = config.speculative
    if spec is None:
        return {}
    return dict(num_speculative_tokens=spec.num_speculative_tokens, prompt_lookup_min=spec.prompt_lookup_min,
                prompt_lookup_max=spec.prompt_lookup_max, speculative_method=spec.method,
                speculative_max_batch=spec.disable_by_batch_size)
