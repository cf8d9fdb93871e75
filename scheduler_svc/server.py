"""The scheduler as a gRPC service (`pagoda.v1.Scheduler`): the gateway's one door.

A thin servicer: validate -> convert -> call the engine -> convert. Bad input gets
INVALID_ARGUMENT naming the field, a full queue RESOURCE_EXHAUSTED; a client that cancels
its Generate stream aborts the request (and so frees its blocks). GetStats carries the
stages' and the KV service's statistics, so the gateway never reaches past the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import replace

import grpc

from scheduler_svc.config import SchedulerConfig, kv_capacity_line
from scheduler_svc.core.lora import AdapterNotServed, LoraAdapter, new_load_id
from scheduler_svc.core.queue import QueueFull
from scheduler_svc.core.request import FinishReason, Request, RequestState
from scheduler_svc.engine import Engine, admission_limits
from scheduler_svc.kv_transfer import KVImporter, disaggregation_to_pb, export_to_pb
from scheduler_svc.outputs import RequestOutput
from scheduler_svc.request_stream import Refused, RequestStream
from services import grammar, local_stream
from services.admission import AdmissionError, admit, admit_pooling
from services.grpc_utils import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PIPELINE_DOWN,
    UNAVAILABLE_REASON_KEY,
    create_aio_server,
    serve_until_signalled,
    set_serving,
    status_from_value,
)
from services.kv_client import KVCacheClient
from services.kv_layout import parse_spec
from services.pb import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from services.pooling import PoolingType, embedding_to_pb
from services.sampling_pb import options_from_pb, set_top_logprobs

log = logging.getLogger(__name__)
SERVICE_NAME = "pagoda.v1.Scheduler"
LORA_DRAIN_TIMEOUT_S = 60.0  # how long an unload waits for the requests under the adapter

_FINISH = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_STATE = {
    RequestState.WAITING: common_pb2.REQUEST_STATE_WAITING,
    RequestState.PREFILLING: common_pb2.REQUEST_STATE_PREFILLING,
    RequestState.DECODING: common_pb2.REQUEST_STATE_DECODING,
    RequestState.PREEMPTED: common_pb2.REQUEST_STATE_PREEMPTED,
    RequestState.FINISHED: common_pb2.REQUEST_STATE_FINISHED,
    RequestState.ABORTED: common_pb2.REQUEST_STATE_ABORTED,
}


class InvalidRequest(ValueError):
    pass


def request_from_pb(msg: scheduler_pb2.GenerateRequest, config: SchedulerConfig, vocab_size: int) -> Request:
    """Validate a GenerateRequest whole; raises InvalidRequest naming the field."""
    prompt = tuple(msg.prompt_token_ids)
    if not prompt:
        raise InvalidRequest("prompt_token_ids: the prompt is empty")
    if vocab_size and max(prompt) >= vocab_size:
        raise InvalidRequest(f"prompt_token_ids: token id {max(prompt)} is outside the vocabulary of {vocab_size}")
    if not config.enable_chunked_prefill and len(prompt) > config.max_num_batched_tokens:
        raise InvalidRequest(
            f"prompt_token_ids: {len(prompt)} tokens exceed max_num_batched_tokens="
            f"{config.max_num_batched_tokens} without chunked prefill"
        )
    tenant = msg.tenant
    if config.enforce_tenants and tenant not in config.tenant_weights:
        raise InvalidRequest(f"tenant: unknown tenant {tenant!r}")
    try:
        pooling = PoolingType.from_pb(msg.pooling)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    check = admit if pooling is None else admit_pooling  # (a pooling request may fill the context)
    try:
        options = check(options_from_pb(msg.sampling_params), admission_limits(config, vocab_size), len(prompt))
    except AdmissionError as exc:
        where = "prompt_token_ids" if exc.field == "prompt" else f"sampling_params.{exc.path}"
        raise InvalidRequest(f"{where}: {exc.reason}") from exc
    except ValueError as exc:
        raise InvalidRequest(f"sampling_params.{exc}") from exc
    return Request(
        request_id=msg.request_id or uuid.uuid4().hex,
        prompt=prompt,
        options=options,
        arrival_s=0.0,
        tenant=tenant,
        priority=msg.priority,
        debug_timeline=msg.debug_timeline,
        trace_context=msg.trace_context.traceparent if msg.HasField("trace_context") else "",
        pooling=pooling,
        lora_name=_lora_name(msg.lora_name),
    )


def _lora_name(name: str) -> str:
    if len(name) > 256 or any(c in name for c in "\x00\n"):
        raise InvalidRequest("lora_name: at most 256 characters, no NUL or newline")
    return name


def check_structured(structured) -> None:
    """InvalidRequest naming the field when a structured-output constraint does not compile.
    The gateway checks it at its doors; a direct caller's bad grammar must not reach a stage,
    which would refuse the whole micro-batch it rides in."""
    try:
        grammar.check(structured)
    except grammar.GrammarError as exc:
        raise InvalidRequest(f"sampling_params.structured_output: {exc}") from exc


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self, engine: Engine, kv_address: str = "in-process", max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        self.engine = engine
        self.kv_address = kv_address
        self.epoch = secrets.randbits(63) | 1
        self.started_ns = time.time_ns()
        cfg = engine.config
        self.importer = KVImporter(engine.kv, engine.transport, cfg.block_size, cfg.model or None)
        # GenerateStream on this host's local socket too (services/local_stream.py), unless set to gRPC only
        self.listener: local_stream.LocalListener | None = None
        if cfg.request_channel != "grpc":
            self.listener = local_stream.LocalListener(
                {"GenerateStream": self._local_generate_stream}, max_message_bytes
            )

    async def Generate(self, request, context):
        traceparent = dict(context.invocation_metadata() or ()).get("traceparent", "")
        try:
            req, stream = await self.admit(request, traceparent)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        try:
            async for out in stream:
                if out.error is not None:
                    failure = self.failure(req.request_id, out.error)
                    await context.abort(
                        status_from_value(failure.code),
                        failure.message,
                        trailing_metadata=((UNAVAILABLE_REASON_KEY, PIPELINE_DOWN),) if failure.pipeline_down else (),
                    )
                for msg in self.responses(req, out):
                    yield msg
        finally:
            await stream.aclose()  # a cancelled client aborts the request here

    async def GenerateStream(self, request_iterator, context):
        """Many requests on one stream (scheduler_svc/request_stream.py)."""
        async for events in RequestStream(self).run(request_iterator):
            yield events

    async def _local_generate_stream(self, stream: local_stream.ServerStream) -> None:
        """GenerateStream opened on the local socket: the same commands and events, framed."""
        async for events in RequestStream(self).run(stream.messages(scheduler_pb2.StreamCommand)):
            await stream.write(events)

    async def LocalEndpoint(self, request, context):
        return local_stream.endpoint(self.listener)

    async def admit(self, request: scheduler_pb2.GenerateRequest, traceparent: str = "", sink=None):
        """A GenerateRequest validated and queued: (the request, its outputs to iterate), or
        with `sink` (the engine puts each output there) (the request, its LiveRequest).
        Refused with the status Generate ends with."""
        if not self.engine.stages:  # (the gateway retries UNAVAILABLE before anything streamed)
            raise Refused(
                grpc.StatusCode.UNAVAILABLE, "the scheduler is starting: its stages are not connected yet; retry"
            )
        try:
            req = request_from_pb(request, self.engine.config, self.engine.vocab_size)
            if req.options.structured is not None:  # (a compile: off the event loop)
                await asyncio.to_thread(check_structured, req.options.structured)
            if not req.trace_context:  # per-request calls may carry it in metadata instead
                req.trace_context = traceparent
            req.export_kv = request.kv_export and bool(getattr(self.engine.transport, "addresses", None))
            if req.export_kv and not self.engine.healthy:  # (its gateway has the decode side compute it)
                raise Refused(grpc.StatusCode.UNAVAILABLE, f"kv_export: {self.engine.health_detail}")
            if request.HasField("kv_import"):  # P/D: the prompt's blocks first (kv_transfer.py)
                await self.importer.run(req, request.kv_import)
            return req, (self.engine.submit(req) if sink is None else self.engine.submit_to(req, sink))
        except InvalidRequest as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except AdapterNotServed as exc:
            raise Refused(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        except QueueFull as exc:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except ValueError as exc:  # a duplicate request id
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {exc}") from None

    def failure(self, request_id: str, error: tuple[str, str]) -> scheduler_pb2.RequestFailure:
        """An engine output's error as the status its request ends with."""
        code, message = error
        status = getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL)
        down = code == "UNAVAILABLE" and not self.engine.healthy  # (not a shutdown)
        return scheduler_pb2.RequestFailure(
            request_id=request_id, code=status.value[0], message=message, pipeline_down=down
        )

    def responses(self, req: Request, out: RequestOutput) -> list[scheduler_pb2.GenerateResponse]:
        """One engine output as responses: one per choice's delta; the prompt's logprobs ride
        on the first, the usage and timeline of a finished request on the last (an empty
        response carries them when there is no delta)."""
        msgs = [_delta_to_pb(req.request_id, d) for d in out.deltas or []]
        if out.prompt_logprobs is not None:
            if not msgs:
                msgs.append(scheduler_pb2.GenerateResponse(request_id=req.request_id))
            for token_id, logprob, rank, top in out.prompt_logprobs:
                set_top_logprobs(msgs[0].prompt_logprobs.add(), token_id, logprob, rank, top)
        if out.finished:
            if not msgs:
                msgs.append(scheduler_pb2.GenerateResponse(request_id=req.request_id))
            _finish_to_pb(out, msgs[-1])
            stages = getattr(self.engine.transport, "addresses", None) or []
            export_to_pb(out.kv_export, stages, self.engine.config.block_size, msgs[-1])
        return msgs

    async def Abort(self, request, context):
        index = request.index if request.HasField("index") else None
        return scheduler_pb2.AbortResponse(aborted=self.engine.abort(request.request_id, index))

    async def LoadLoraAdapter(self, request, context):
        """Loads an adapter on every stage under a fresh identity, then serves it."""
        transport, loras = self._lora_transport(), self.engine.loras
        if transport is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this scheduler's stages are in-process")
        if not self.engine.stages:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the scheduler is starting: its stages are not connected yet; retry"
            )
        name = request.lora_name
        if not name or not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path: required")
        if loras.get(name) is not None:
            what = "is being unloaded" if loras.is_draining(name) else "is loaded already"
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"lora_name: an adapter {name!r} {what}")
        adapter = LoraAdapter(name, request.lora_path, new_load_id())
        try:
            await transport.load_lora(adapter, loras)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
        except ValueError as exc:  # (two loads of one name at once: the other won)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        log.info("LoRA adapter %r loaded from %s (load id %x)", name, adapter.path, adapter.load_id)
        return self._lora_reply()

    async def UnloadLoraAdapter(self, request, context):
        """Drains an adapter, then unloads it from every stage: no new request is admitted
        under it; those running end first, or end NOT_FOUND after the drain timeout."""
        transport, engine = self._lora_transport(), self.engine
        if transport is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this scheduler's stages are in-process")
        name = request.lora_name
        try:
            engine.loras.drain(name)
        except KeyError:
            what = "is being unloaded already" if engine.loras.is_draining(name) else "is loaded"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"lora_name: no adapter {name!r} {what}")
        timeout_s = request.drain_timeout_s if request.drain_timeout_s > 0 else LORA_DRAIN_TIMEOUT_S
        try:
            drained = await self._drained(name, timeout_s)
        except asyncio.CancelledError:  # the caller went away: the adapter serves on
            engine.loras.resume(name)
            raise
        if not drained:
            ended = engine.end_lora_requests(
                name, f"model: the LoRA adapter {name!r} was unloaded (its drain timeout of {timeout_s:g} s passed)"
            )
            log.warning("LoRA adapter %r: %d requests still ran after %g s: ended", name, ended, timeout_s)
            await self._drained(name, LORA_DRAIN_TIMEOUT_S)  # (their steps in flight come back)
        await transport.unload_lora(name, engine.loras)
        log.info("LoRA adapter %r unloaded", name)
        return self._lora_reply()

    async def ListLoraAdapters(self, request, context):
        return self._lora_reply()

    def _lora_transport(self):
        """The transport that loads adapters on the stages; None for in-process stages."""
        transport = self.engine.transport
        return transport if hasattr(transport, "load_lora") else None

    async def _drained(self, name: str, timeout_s: float) -> bool:
        """Waits until nothing runs under adapter `name` (True), or `timeout_s` (False)."""
        deadline = time.monotonic() + timeout_s
        while self.engine.lora_busy(name):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def _lora_reply(self) -> worker_pb2.LoraAdapterReply:
        """The adapters served (not one being unloaded)."""
        served = self.engine.loras.served
        return worker_pb2.LoraAdapterReply(
            lora_names=[a.name for a in served],
            lora_adapters=[
                worker_pb2.LoraAdapterInfo(lora_name=a.name, lora_path=a.path, load_id=a.load_id) for a in served
            ],
        )

    async def GetStats(self, request, context):
        engine, cfg = self.engine, self.engine.config
        s = engine.summary()
        resp = scheduler_pb2.GetStatsResponse(
            health=common_pb2.HEALTH_STATUS_SERVING if s["healthy"] else common_pb2.HEALTH_STATUS_NOT_SERVING,
            health_detail=s["health_detail"],
            epoch=self.epoch,
            uptime_ns=time.time_ns() - self.started_ns,
            num_waiting=s["num_waiting"],
            num_running=s["num_running"],
            num_preempted=s["num_preempted"],
            num_preemptions=s["num_preemptions"],
            num_finished_requests=s["num_finished"],
            num_aborted_requests=s["num_aborted"],
            num_prompt_tokens=s["num_prompt_tokens"],
            num_generated_tokens=s["num_generated_tokens"],
            num_micro_batches=s["num_micro_batches"],
            num_in_flight=s["num_in_flight"],
            kv_address=self.kv_address,
            num_spec_drafts=s["spec"].num_drafts,
            num_spec_draft_tokens=s["spec"].num_draft_tokens,
            num_spec_accepted_tokens=s["spec"].num_accepted_tokens,
            num_spec_accepted_per_position=s["spec"].accepted_per_position,
        )
        _config_to_pb(cfg, resp.config)
        _tenants_to_pb(engine, s, resp)
        disaggregation_to_pb(engine.planner.exports, self.importer.stats, resp.disaggregation)
        # the stages and the KV service are asked at once, each bounded well inside the
        # gateway's 2 s deadline: a hung stage shows as not serving instead of a 504
        kv_reply = asyncio.ensure_future(asyncio.wait_for(engine.kv.stats_message(request.include_kv_sequences), 1.5))
        for st in await engine.transport.stage_stats(timeout_s=1.5):
            _stage_to_pb(engine, st, resp)
        try:
            resp.kv_cache.CopyFrom(await kv_reply)
            resp.kv_health = common_pb2.HEALTH_STATUS_SERVING
        except Exception as exc:  # the KV service is down: say so, don't fail the call
            resp.kv_health = common_pb2.HEALTH_STATUS_NOT_SERVING
            resp.health_detail += f"; KV service: {exc}"
        if request.include_timeline:
            for stage_index, mb_id, start_ns, end_ns, received_ns in list(engine.recent_spans):
                resp.timeline.add(
                    stage_index=stage_index,
                    micro_batch_id=mb_id,
                    start_ns=start_ns,
                    end_ns=end_ns,
                    received_ns=received_ns,
                )
        resp.now_ns = time.time_ns()
        if request.include_requests:
            _requests_to_pb(engine, resp)
        return resp


def _delta_to_pb(request_id: str, d) -> scheduler_pb2.GenerateResponse:
    """One choice's new tokens (a `RequestOutput` delta) as a response."""
    msg = scheduler_pb2.GenerateResponse(request_id=request_id, index=d.index)
    msg.token_ids.extend(d.token_ids)
    for token_id, lp in zip(d.token_ids, d.logprobs, strict=True):
        if lp is not None:  # (rank 0: a sampled token's rank is not computed)
            set_top_logprobs(msg.logprobs.add(), token_id, lp.logprob, 0, lp.top)
    if d.finish_reason is not None:
        msg.finish_reason = _FINISH[d.finish_reason]
        if d.stop_token_id is not None:
            msg.stop_token_id = d.stop_token_id
    return msg


def _finish_to_pb(out: RequestOutput, last: scheduler_pb2.GenerateResponse) -> None:
    """A finished request's usage, timeline and (pooling) vector, on its last response."""
    if out.embedding is not None:
        embedding_to_pb(out.embedding, last.embedding)
    last.usage.num_prompt_tokens = out.num_prompt_tokens
    last.usage.num_completion_tokens = out.num_completion_tokens
    last.usage.num_cached_tokens = out.num_cached_tokens
    last.usage.num_preemptions = out.num_preemptions
    for e in out.timeline:
        ev = last.timeline.add(
            name=e["name"],
            category=e.get("category", "scheduler"),
            start_ns=e.get("start_ns", 0),
            end_ns=e.get("end_ns", 0),
        )
        for field in ("stage_index", "micro_batch_id", "choice_index", "num_tokens"):
            if field in e:
                setattr(ev, field, e[field])


def _config_to_pb(cfg: SchedulerConfig, c) -> None:
    c.model, c.pipeline_parallel_size, c.async_scheduling = cfg.model, cfg.pipeline_parallel_size, cfg.is_async
    c.scheduler_policy, c.max_num_batched_tokens, c.max_num_seqs = (
        cfg.scheduler_policy,
        cfg.max_num_batched_tokens,
        cfg.max_num_seqs,
    )
    c.microbatch_size, c.enable_chunked_prefill = str(cfg.microbatch_size), cfg.enable_chunked_prefill
    c.enable_prefix_caching, c.preemption_mode, c.block_size = (
        cfg.enable_prefix_caching,
        cfg.preemption_mode,
        cfg.block_size,
    )
    c.num_kv_blocks, c.max_model_len, c.scheduler_timeout_ms = (
        cfg.num_kv_blocks or 0,
        cfg.max_model_len,
        cfg.scheduler_timeout_ms,
    )


def _tenants_to_pb(engine: Engine, s: dict, resp: scheduler_pb2.GetStatsResponse) -> None:
    """Every tenant that is configured or has queued requests."""
    cfg = engine.config
    tenants = set(s["queue_by_tenant"]) | set(cfg.tenant_weights)
    for tenant in sorted(tenants):
        resp.tenants.add(
            tenant=tenant,
            num_waiting=s["queue_by_tenant"].get(tenant, 0),
            num_running=sum(1 for r in engine.planner.running if r.tenant == tenant),
            num_served_tokens=s["served_tokens_by_tenant"].get(tenant, 0),
            weight=cfg.tenant_weights.get(tenant, 1.0),
        )


def _stage_to_pb(engine: Engine, st: dict, resp: scheduler_pb2.GetStatsResponse) -> None:
    """One stage's health, statistics and (once connected) what it loaded."""
    ps = resp.stages.add(stage_index=st["stage_index"], address=st["address"])
    ps.health = common_pb2.HEALTH_STATUS_SERVING if st["healthy"] else common_pb2.HEALTH_STATUS_NOT_SERVING
    stats = st.get("stats")
    if stats is not None:
        ps.stats.CopyFrom(stats)
        total = stats.busy_ns + stats.idle_ns
        ps.busy_fraction = stats.busy_ns / total if total else 0.0
        ps.num_in_flight = stats.num_in_flight
        # the bubble: time requests were live but this stage was not computing
        engine.update_active_time()
        ps.bubble_ns = max(0, engine.active_ns - stats.busy_ns)
    elif "busy_ns" in st:
        uptime = resp.uptime_ns or 1
        ps.busy_fraction = min(1.0, st["busy_ns"] / uptime)
    if st["stage_index"] < len(engine.stages):
        info = engine.stages[st["stage_index"]]
        li = ps.load_info
        li.stage_index, li.num_stages, li.epoch = info.stage_index, info.num_stages, info.epoch
        li.layer_start, li.layer_end, li.num_layers = info.layer_start, info.layer_end, info.num_layers
        li.num_kv_blocks, li.block_size, li.vocab_size = info.num_kv_blocks, info.block_size, info.vocab_size
        li.feedback_connected = info.feedback and info.stage_index == 0  # in use by the scheduler
        li.weights_bytes, li.quantization = info.weights_bytes, info.quantization
        li.expert_weights_bytes = info.expert_weights_bytes
        li.kv_block_bytes, li.kv_cache_dtype = info.kv_block_bytes, info.kv_cache_dtype
        li.memory_budget_bytes, li.device = info.memory_budget_bytes, info.device
        li.cpu = info.cpu


def _requests_to_pb(engine: Engine, resp: scheduler_pb2.GetStatsResponse) -> None:
    for r in list(engine.planner.requests.values()):
        resp.requests.add(
            request_id=r.request_id,
            state=_STATE[r.state],
            tenant=r.tenant,
            priority=r.priority,
            num_prompt_tokens=len(r.prompt),
            num_output_tokens=r.num_output_tokens,
            num_preemptions=r.num_preemptions,
        )


async def serve(
    config: SchedulerConfig,
    host: str,
    port: int,
    kv_address: str,
    kv: KVCacheClient,
    stage_addresses: list[str],
    ready_file: str | None = None,
    startup_timeout_s: float = 120.0,
    metrics_port: int | None = None,
) -> None:
    from scheduler_svc.transport import GrpcStageTransport
    from services import telemetry
    from services.text import Tokenizer

    telemetry.setup_tracing("scheduler")
    eos = Tokenizer(config.model).eos_token_ids if config.model else ()
    transport = GrpcStageTransport(stage_addresses)
    engine = Engine(config, kv, transport, eos_token_ids=tuple(eos))
    service = SchedulerService(engine, kv_address)
    server, bound, health = create_aio_server(f"{host}:{port}")
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
    if service.listener is not None:
        await service.listener.start()
    await server.start()
    await _start_pipeline(engine, kv, config, startup_timeout_s)
    await set_serving(health, SERVICE_NAME, True)
    log.info("scheduler serving on %s:%d (stages %s, KV %s)", host, bound, stage_addresses, kv_address)
    cfg = engine.config
    if cfg.num_kv_blocks:
        log.info(
            "%s",
            kv_capacity_line(
                cfg.num_kv_blocks, cfg.block_size, cfg.max_model_len, cfg.kv_groups, cfg.max_num_batched_tokens
            ),
        )
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_track_health(engine, health, stop))]
    if metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=host, registry=engine.metrics.registry)
        tasks.append(asyncio.create_task(_refresh_metrics(engine, stop)))
        log.info("metrics on http://%s:%d/metrics", host, metrics_port)
    await serve_until_signalled(port=bound, ready_file=ready_file, stop=stop)
    for task in tasks:
        task.cancel()
    await set_serving(health, SERVICE_NAME, False)
    await server.stop(grace=5.0)
    if service.listener is not None:  # (its streams cut after gRPC's calls had their grace)
        await service.listener.close()
    await engine.stop()
    await kv.close()


async def _start_pipeline(engine: Engine, kv, config: SchedulerConfig, startup_timeout_s: float) -> None:
    """Waits for the KV service and the stages, then starts the engine. A KV pool of another
    shape than `config`'s is a ValueError at once; anything else is retried each second until
    `startup_timeout_s` (then RuntimeError). With no configured pool size the engine takes the
    KV service's."""
    deadline = time.monotonic() + startup_timeout_s
    while True:
        try:
            if hasattr(kv, "wait_ready"):
                await kv.wait_ready(5.0)
            kv_stats = await kv.stats()
            if (kv_stats.num_blocks, kv_stats.block_size) != (
                config.num_kv_blocks or kv_stats.num_blocks,
                config.block_size,
            ):
                raise ValueError(
                    f"the KV service has {kv_stats.num_blocks} blocks of {kv_stats.block_size}, "
                    f"the scheduler was told {config.num_kv_blocks} of {config.block_size}"
                )
            groups = ",".join(map(str, kv_stats.group_windows)) if len(kv_stats.group_windows) > 1 else ""
            if config.kv_groups and parse_spec(config.kv_groups) != kv_stats.group_windows:
                raise ValueError(
                    f"the KV service has KV groups {groups or 'none'}, the scheduler was told {config.kv_groups}"
                )
            engine.config = replace(config, num_kv_blocks=config.num_kv_blocks or kv_stats.num_blocks, kv_groups=groups)
            await engine.start()
            return
        except ValueError:
            raise
        except Exception as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"pipeline not ready after {startup_timeout_s}s: {exc}") from exc
            log.info("waiting for the KV service and stages: %s", exc)
            await asyncio.sleep(1.0)


async def _refresh_metrics(engine: Engine, stop: asyncio.Event, period_s: float = 1.0) -> None:
    """Gauges read from the engine, the KV service and the stages, once a period."""
    while not stop.is_set():
        try:
            kv_stats = await asyncio.wait_for(engine.kv.stats(), 2.0)
        except Exception:  # the KV service is down: keep the last values
            kv_stats = None
        try:
            stage_stats = await engine.transport.stage_stats()
        except Exception:
            stage_stats = []
        engine.metrics.refresh(engine.summary(), kv_stats, stage_stats)
        await asyncio.sleep(period_s)


async def _track_health(engine: Engine, health, stop: asyncio.Event) -> None:
    serving = True
    while not stop.is_set():
        if engine.healthy != serving:
            serving = engine.healthy
            await set_serving(health, SERVICE_NAME, serving)
        await asyncio.sleep(0.5)
