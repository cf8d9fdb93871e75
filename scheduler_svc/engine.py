"""The scheduler's event loop: requests in, micro-batches out, results back, failures handled.

One asyncio task owns the planner. It reacts to events — a request arrives or is aborted,
a micro-batch result or error comes back, a stage goes down — and plans the next
micro-batch while others execute (`async_scheduling`), so no stage waits on planning, on
the KV service's round trip or on the network. With `async_scheduling=False` it plans,
runs, waits and repeats, for comparison.

Transports carry micro-batches to the stages: over gRPC (`scheduler_svc.transport`) or to
in-process stage runners (`wiring.local_engine`); the KV client is in-process or gRPC.
The scheduling code is the same for all of them. What they promise and report is in
`scheduler_svc.events`; what clients receive, in `scheduler_svc.outputs`; how the engine meets
a failed step, a stage or KV service gone, or a late step, in `scheduler_svc.recovery`.

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

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.deadlines import StepDeadlines
from scheduler_svc.core.lora import LoraRegistry
from scheduler_svc.core.planner import Planner, PlannerConfig, SeqUpdate
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request, RequestState
from scheduler_svc.events import (
    ErrorEvent,
    KVClient,
    ProgressReport,
    StageDownEvent,
    StageInfo,
    StageTransport,
    check_stages,
)
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.observer import EngineObserver, Outcome
from scheduler_svc.outputs import ChoiceDelta, LiveRequest, OutputSink, RequestOutput, final_output, stream_outputs
from scheduler_svc.recovery import FailureHandling
from services.admission import Limits, admit, admit_pooling
from services.kv_layout import entries_that_fit, parse_spec
from services.kv_types import StepOutput
from services.step import StepResult

log = logging.getLogger(__name__)
_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11's timeout context; None on 3.10
_NO_KV_CHANGES = StepOutput(results={}, copies=())


def admission_limits(config: SchedulerConfig, vocab_size: int) -> Limits:
    """What the scheduler admits a request against (`services.admission`), at its edge and in
    `Engine.submit`: the context, the model's vocabulary (0 until a stage reports it: not
    checked), max_num_seqs choices, the KV pool."""
    return Limits(
        max_model_len=config.max_model_len,
        vocab_size=vocab_size,
        max_n=config.max_num_seqs,
        num_kv_blocks=kv_entries(config),
        block_size=config.block_size,
    )


def kv_entries(config: SchedulerConfig) -> int:
    """The KV pool in block positions one sequence can hold (with KV groups, pages are
    shared out among the sub-groups: services/kv_layout.py); 0 when not known yet."""
    pages = config.num_kv_blocks or 0
    if not pages or not config.kv_groups:
        return pages
    return entries_that_fit(pages, parse_spec(config.kv_groups), config.block_size, config.max_num_batched_tokens)


class Engine(FailureHandling):
    """Owns a Planner; one asyncio task runs the loop. Its failure handling (a failed step, a
    stage or the KV service gone, a late step) is `FailureHandling`'s (scheduler_svc/recovery.py)."""

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
            config.scheduler_policy, config.tenant_weights, aging_rate=config.aging_rate, max_len=config.max_queue_len
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
        self.observer = EngineObserver(
            self.planner,
            metrics or SchedulerMetrics(config.model),
            clock,
            config.trace_file,
            prefix_caching=config.enable_prefix_caching,
        )
        self.stages: list[StageInfo] = []
        self.loras = LoraRegistry()  # the LoRA adapters the stages serve (core/lora.py)
        self.healthy = False
        self.health_detail = "starting"
        self._live: dict[str, LiveRequest] = {}
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
                self.end_lora_requests(
                    name,
                    f"model: the LoRA adapter {name!r} could not be loaded again "
                    "on a restarted stage, and was unloaded",
                )
        self.stages = stages
        check_stages(stages, self.config)
        self.planner.set_feedback(self.stages[0].feedback)
        self.healthy = True
        self.health_detail = "serving"
        self._unhealthy_since = None

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
    def recent_spans(self) -> deque[tuple[int, int, int, int, int]]:
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
        live = self.submit_to(request, asyncio.Queue())
        return stream_outputs(live, self.abort)

    def submit_to(self, request: Request, sink: OutputSink) -> LiveRequest:
        """Queue a request whose outputs the engine puts into `sink` as it makes them (no task
        per request reads them: `scheduler_svc/request_stream.py`); its consumer aborts it
        if it goes first. Raises QueueFull, ValueError."""
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
                self._finish(
                    gone,
                    "abort",
                    "displaced",
                    (
                        "RESOURCE_EXHAUSTED",
                        "the waiting queue is full: this request gave its place to a more urgent one; retry later",
                    ),
                )
        self.update_active_time()  # the time before this arrival counts as idle if nothing was live
        live = LiveRequest(request, sink)
        self._live[request.request_id] = live
        self.observer.request_admitted(request)
        self._wake()
        return live

    def _fit_to_context(self, request: Request) -> None:
        """Admit the request's options (`services.admission`, as the server does at its edge),
        resolving max_tokens to the context it has; AdmissionError (a ValueError) if it could
        never run."""
        check = admit if request.pooling is None else admit_pooling
        request.options = check(request.options, admission_limits(self.config, self.vocab_size), len(request.prompt))

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Abort a request, or with `index` end just that choice (a stop string matched at the
        gateway: counted as a stop, as the gateway counts it)."""
        live = self._live.get(request_id)
        if live is None:  # ended: maybe its KV is held for a decode replica (P/D), now released
            released = index is None and self.planner.release_export(request_id)
            if released:
                self._wake()
            return released
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
        return any(r.lora_name == name for r in planner.requests.values()) or any(
            s.seq.request.lora_name == name for mb in planner.in_flight.values() for s in mb.seqs
        )

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
                if len(self.planner.exports):
                    self.planner.expire_exports(self.clock())
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
        updates = self.planner.on_result(
            event.step_id, event.sampled, now, event.prompt_logprobs, event.pooled, event.proposals
        )
        self.observer.micro_batch_returned(event, now)
        self._deliver(updates)

    def _deliver(self, updates: list[SeqUpdate]) -> None:
        touched: dict[str, list[ChoiceDelta]] = {}
        for u in updates:
            seq = u.seq
            delta = ChoiceDelta(
                seq.index,
                u.new_token_ids,
                u.new_logprobs,
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
                out.kv_export = request.exported
                if request.pooling is not None and request.embedding is None:
                    out.error = ("INTERNAL", "the last stage returned no pooled vector")
            else:
                out = RequestOutput(request_id, deltas)
            if request.options.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                # complete by now: the prompt's last chunk precedes the first sampled token
                out.prompt_logprobs = list(request.prompt_logprobs)
                request.prompt_logprobs_sent = True
            live.outputs.put_nowait(out)

    def _final(
        self, live: LiveRequest, reason: str | None, outcome: Outcome, error: tuple[str, str] | None = None
    ) -> RequestOutput:
        """The request's last output. It ended with `outcome`, counted under finish `reason`
        (None: not counted); an abort ends each choice still going with ABORT."""
        timeline = self.observer.request_finished(live.request, reason, outcome)
        return final_output(live.request, outcome == "aborted", timeline, error)

    def _finish(
        self, live: LiveRequest, reason: str | None, outcome: Outcome, error: tuple[str, str] | None = None
    ) -> None:
        live.outputs.put_nowait(self._final(live, reason, outcome, error))

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


def _speculation(config: SchedulerConfig) -> dict:
    """The planner's speculative-decoding settings (none without --speculative-config)."""
    spec = config.speculative
    if spec is None:
        return {}
    return dict(
        num_speculative_tokens=spec.num_speculative_tokens,
        prompt_lookup_min=spec.prompt_lookup_min,
        prompt_lookup_max=spec.prompt_lookup_max,
        speculative_method=spec.method,
        speculative_max_batch=spec.disable_by_batch_size,
    )
