"""The KV-cache manager as a gRPC service (`pagoda.v1.KVCache`).

A thin servicer: decode -> `KVCacheManager` -> encode. The servicer owns its one manager;
every call runs on the event loop and the core is synchronous, so calls never interleave
and need no locks. Caller errors map to status codes (`SequenceNotFound` -> NOT_FOUND,
`InvalidStepError` -> INVALID_ARGUMENT) with nothing applied; running short of blocks is a
per-sequence NO_BLOCKS result, not an error.

When no mutating call came for `integrity_check_idle_s` (and after every Reset) the
manager's `check_integrity()` runs. It is linear in the pool (about 200 ms at 100k blocks)
and holds the event loop, so the idle time it waits for is also at least ten times its
last duration: a call arriving mid-check waits at most a tenth of the idle time before it.

If the check fails, or a call fails on a bug, the bookkeeping can no longer be trusted:
the error is logged, health turns NOT_SERVING and Step, Fork and Free answer UNAVAILABLE
until a Reset, which is what a scheduler does when the KV service fails (preempt
everything, reset, go on).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import NoReturn

import grpc
from grpc_health.v1 import health

from kvcache_svc.config import KVCacheConfig
from kvcache_svc.core import InvalidStepError, KVCacheError, KVCacheManager, SequenceNotFound, StepInput
from kvcache_svc.core.tier import plan_import, tier_for
from kvcache_svc.events import Event, EventLog, Gone, Removed, Stored, chains
from services import local_stream
from services.grpc_utils import create_aio_server, serve_until_signalled, set_serving
from services.kv_codec import (
    SEQ_ID_METADATA_KEY,
    capacity_to_pb,
    forks_from_pb,
    stats_to_pb,
    status_code_of,
    step_input_from_pb,
    step_output_to_pb,
)
from services.pb import kvcache_pb2, kvcache_pb2_grpc
from services.prefix_hash import ROOT_KEY

log = logging.getLogger(__name__)
SERVICE_NAME = "pagoda.v1.KVCache"


async def _abort_for(context: grpc.aio.ServicerContext, exc: KVCacheError) -> NoReturn:
    metadata = ()
    if isinstance(exc, SequenceNotFound):
        metadata = ((SEQ_ID_METADATA_KEY, str(exc.seq_id)),)
    await context.abort(status_code_of(exc), str(exc), trailing_metadata=metadata)
    raise AssertionError("unreachable")  # abort raises


class KVCacheService(kvcache_pb2_grpc.KVCacheServicer):
    """`pagoda.v1.KVCache` over one `KVCacheManager`, which this servicer owns.

    `epoch` is drawn at construction (a new one per process start). `broken` is None while
    the bookkeeping is trusted, else why it is not; only a Reset clears it.
    """

    def __init__(self, config: KVCacheConfig, health_servicer: health.aio.HealthServicer | None = None) -> None:
        self.config = config
        self.epoch = secrets.randbits(63) | 1  # never 0
        self.events = EventLog(self.epoch, config.events_kept)  # KV events (kvcache_svc/events.py)
        self.manager = KVCacheManager(
            config.num_blocks,
            config.block_size,
            watermark=config.watermark,
            enable_prefix_caching=config.enable_prefix_caching,
            group_windows=config.group_windows,
            listener=self.events,
            tier=tier_for(config.kv_offload, self.events, config.kv_import_blocks),
        )
        self.publisher = None  # kvcache_svc.publisher.RedisPublisher with --redis-url
        self.broken: str | None = None
        self.num_steps = 0
        self.num_peak_used_blocks = 0
        self.num_integrity_checks = 0
        self.last_integrity_check_s = 0.0
        self._health = health_servicer
        self._changed_since_check = False
        self._last_change_s = time.monotonic()
        self._checker: asyncio.Task | None = None
        self.listener: local_stream.LocalListener | None = None  # Step on the local socket (create_server)

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Report SERVING and start the idle integrity checks (and the Redis publisher)."""
        if self.listener is not None:
            await self.listener.start()
        if self.config.integrity_check_idle_s > 0:
            self._checker = asyncio.create_task(self._idle_checks(), name="integrity-check")
        if self.config.redis_url:
            from kvcache_svc.publisher import RedisPublisher

            self.publisher = RedisPublisher(
                self.config.redis_url, self.config.replica_id, self.events, self.snapshot, self.config.block_size
            )
            self.publisher.start()
        await self._set_serving(True)

    def snapshot(self) -> list[Stored]:
        """Every cached block as a one-block `Stored` (as of `events.last_sequence_number`),
        then every block of the KV tier with its medium."""
        tier = [Stored((key,), b"", (), None, medium) for key, medium in self.manager.tier_keys()]
        return chains(self.manager.cached_blocks()) + tier

    async def stop(self) -> None:
        await self._set_serving(False)
        if self.listener is not None:
            await self.listener.close()
        if self.publisher is not None:
            await self.publisher.stop()
        if self._checker is not None:
            self._checker.cancel()
            try:
                await self._checker
            except asyncio.CancelledError:
                pass
            self._checker = None

    async def _set_serving(self, serving: bool) -> None:
        if self._health is not None:
            await set_serving(self._health, SERVICE_NAME, serving)

    async def _idle_checks(self) -> None:
        while True:
            idle_s = max(self.config.integrity_check_idle_s, 10 * self.last_integrity_check_s)
            await asyncio.sleep(idle_s / 2)
            if self._changed_since_check and time.monotonic() - self._last_change_s >= idle_s:
                await self.check_integrity()

    async def check_integrity(self) -> bool:
        """Run the manager's invariant check now; on failure mark the service broken."""
        self._changed_since_check = False
        self.num_integrity_checks += 1
        start = time.perf_counter()
        try:
            self.manager.check_integrity()
        except Exception as exc:  # IntegrityError, or a bug in the check itself
            await self._mark_broken(f"integrity check failed: {exc}")
            return False
        finally:
            self.last_integrity_check_s = time.perf_counter() - start
        log.debug("integrity check passed in %.1f ms", 1e3 * self.last_integrity_check_s)
        return True

    async def _mark_broken(self, reason: str) -> None:
        if self.broken is None:
            log.error("KV bookkeeping cannot be trusted until a Reset: %s", reason)
            self.broken = reason
            await self._set_serving(False)

    def _changed(self) -> None:
        self.events.flush()
        self._changed_since_check = True
        self._last_change_s = time.monotonic()
        num_used = self.manager.num_blocks - self.manager.num_available_blocks
        self.num_peak_used_blocks = max(self.num_peak_used_blocks, num_used)

    def _capacity(self) -> kvcache_pb2.KVCapacity:
        m = self.manager
        return capacity_to_pb(m.num_blocks, m.num_available_blocks, m.num_evictable_blocks)

    async def _apply(self, context: grpc.aio.ServicerContext, method: str, step: StepInput):
        """Run a validated-whole core step; errors become status codes, nothing applied."""
        if self.broken is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV state not trusted, Reset it: {self.broken}")
        try:
            output = self.manager.step(step)
        except KVCacheError as exc:
            self.events.flush()  # (validated whole: nothing changed, nothing to tell)
            await _abort_for(context, exc)
        except Exception as exc:  # a bug: the state may be half-applied
            self.events.flush()
            log.exception("%s failed on a bug", method)
            await self._mark_broken(f"{method} raised {type(exc).__name__}: {exc}")
            await context.abort(grpc.StatusCode.INTERNAL, f"{method}: {type(exc).__name__}")
        self._changed()
        return output

    # ---- rpcs ----------------------------------------------------------------------------

    async def Step(self, request: kvcache_pb2.StepRequest, context) -> kvcache_pb2.StepResponse:
        try:
            step = step_input_from_pb(request)
            if request.watermark_blocks not in (0, self.manager.watermark_blocks):
                raise InvalidStepError(
                    f"watermark_blocks {request.watermark_blocks}: only the service's own "
                    f"({self.manager.watermark_blocks}) is supported"
                )
        except KVCacheError as exc:
            await _abort_for(context, exc)
        output = await self._apply(context, "Step", step)
        self.num_steps += 1
        return step_output_to_pb(output, self._capacity(), len(self.manager.group_windows))

    async def local_step(self, stream: local_stream.ServerStream) -> None:
        """Step calls on the local socket: each StepRequest's StepResponse, in order; an
        error ends the stream with Step's status (the caller opens another)."""
        async for request in stream.messages(kvcache_pb2.StepRequest):
            await stream.write(await self.Step(request, stream.context))

    async def LocalEndpoint(self, request, context):
        return local_stream.endpoint(self.listener)

    async def Fork(self, request: kvcache_pb2.ForkRequest, context) -> kvcache_pb2.ForkResponse:
        await self._apply(context, "Fork", StepInput(forks=forks_from_pb(request.forks)))
        return kvcache_pb2.ForkResponse(capacity=self._capacity())

    async def Free(self, request: kvcache_pb2.FreeRequest, context) -> kvcache_pb2.FreeResponse:
        num_available = self.manager.num_available_blocks
        await self._apply(context, "Free", StepInput(frees=tuple(request.seq_ids)))
        # frees only drop references, so every block that became available was released
        return kvcache_pb2.FreeResponse(
            num_released_blocks=self.manager.num_available_blocks - num_available, capacity=self._capacity()
        )

    async def Stats(self, request: kvcache_pb2.KVStatsRequest, context) -> kvcache_pb2.KVCacheStats:
        m = self.manager
        stats = m.stats()
        sequences, block_map = m.layout() if request.include_sequences else ([], b"")
        reply = stats_to_pb(
            stats,
            epoch=self.epoch,
            num_peak_used_blocks=self.num_peak_used_blocks,
            num_steps=self.num_steps,
            enable_prefix_caching=m.enable_prefix_caching,
            sequences=sequences,
            block_map=block_map,
        )
        if request.reset_peak:
            self.num_peak_used_blocks = stats.num_used_blocks
        return reply

    async def Reset(self, request: kvcache_pb2.ResetRequest, context) -> kvcache_pb2.ResetResponse:
        if request.keep_prefix_cache:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "keep_prefix_cache is not supported")
        num_dropped = len(self.manager.seq_ids())
        self.manager.reset()
        self.events.flush()
        was_broken = self.broken
        self.broken = None
        if await self.check_integrity():
            if was_broken is not None:
                log.info("KV state reset after: %s; serving again", was_broken)
                await self._set_serving(True)
        return kvcache_pb2.ResetResponse(num_dropped_sequences=num_dropped, capacity=self._capacity())

    async def CheckCapacity(
        self, request: kvcache_pb2.CheckCapacityRequest, context
    ) -> kvcache_pb2.CheckCapacityResponse:
        m = self.manager
        if request.watermark_blocks == 0:
            can_allocate = m.can_allocate(request.num_blocks)
        else:
            can_allocate = m.num_available_blocks - request.num_blocks >= request.watermark_blocks
        return kvcache_pb2.CheckCapacityResponse(can_allocate=can_allocate, capacity=self._capacity())

    async def ImportPrefix(self, request: kvcache_pb2.ImportPrefixRequest, context):
        """P/D disaggregation's three moves on the import level (kvcache.proto)."""
        m, phase, Phase = self.manager, request.phase, kvcache_pb2.ImportPrefixRequest
        if self.broken is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV state not trusted, Reset it: {self.broken}")
        try:
            if phase == Phase.PHASE_PLAN:
                namespace = request.namespace if request.HasField("namespace") else None
                cache, tier = m.import_level()
                indices, keys, present = plan_import(
                    cache, tier, namespace, tuple(request.token_ids), request.num_blocks, m.block_size
                )
                return kvcache_pb2.ImportPrefixResponse(
                    block_indices=indices,
                    keys=keys,
                    num_present=present,
                    num_held=tier.num_import,
                    capacity=tier.import_blocks,
                )
            if phase not in (Phase.PHASE_COMMIT, Phase.PHASE_FORGET):
                raise InvalidStepError(f"phase: {phase} is not PLAN, COMMIT or FORGET")
            if len(request.keys) > max(1, m.num_blocks):
                raise InvalidStepError(f"keys: {len(request.keys)} is more than the pool's {m.num_blocks} blocks")
            tier = m.import_level()[1]
            (tier.commit_import if phase == Phase.PHASE_COMMIT else tier.forget)(list(request.keys))
            return kvcache_pb2.ImportPrefixResponse()
        except KVCacheError as exc:
            await _abort_for(context, exc)

    async def SubscribeEvents(self, request: kvcache_pb2.SubscribeEventsRequest, context):
        queue = self.events.subscribe()  # before the backlog is read: nothing falls between
        try:
            try:
                backlog = self.events.since(request.after_sequence_number, request.epoch)
            except Gone as exc:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
            last = request.after_sequence_number
            for event in backlog:
                yield event_to_pb(event, self.config.block_size)
                last = event.sequence_number
            while True:
                event = await queue.get()
                if event is None:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"this subscriber fell behind after event {last}: subscribe again "
                        "after it (or resynchronise from EventsSnapshot)",
                    )
                if event.sequence_number > last:
                    yield event_to_pb(event, self.config.block_size)
                    last = event.sequence_number
        finally:
            self.events.unsubscribe(queue)

    async def EventsSnapshot(self, request: kvcache_pb2.EventsSnapshotRequest, context):
        reply = kvcache_pb2.EventsSnapshotResponse(
            epoch=self.epoch, sequence_number=self.events.last_sequence_number, block_size=self.config.block_size
        )
        for stored in self.snapshot():
            stored_to_pb(stored, self.config.block_size, reply.blocks.add())
        return reply


def stored_to_pb(stored: Stored, block_size: int, out: kvcache_pb2.BlocksStored) -> None:
    out.block_keys.extend(stored.keys)
    if stored.parent_key != ROOT_KEY:
        out.parent_block_key = stored.parent_key
    out.token_ids.extend(stored.token_ids)
    out.block_size = block_size
    if stored.namespace is not None:
        out.namespace = stored.namespace
    out.medium = stored.medium


def event_to_pb(event: Event, block_size: int) -> kvcache_pb2.KVEvent:
    msg = kvcache_pb2.KVEvent(sequence_number=event.sequence_number, epoch=event.epoch)
    change = event.change
    if isinstance(change, Stored):
        stored_to_pb(change, block_size, msg.blocks_stored)
    elif isinstance(change, Removed):
        msg.blocks_removed.block_keys.extend(change.keys)
        msg.blocks_removed.medium = change.medium
    else:
        msg.all_blocks_cleared.SetInParent()
    return msg


def create_server(config: KVCacheConfig) -> tuple[grpc.aio.Server, int, KVCacheService]:
    """A grpc.aio server (not started) bound to `config.address` (port 0 picks one), with the
    servicer and the health service; call inside the event loop that will run it, then
    `await server.start()` and `await service.start()`."""
    server, port, health_servicer = create_aio_server(config.address, config.max_message_bytes)
    service = KVCacheService(config, health_servicer)
    if config.step_channel != "grpc":  # Step on this host's local socket too
        service.listener = local_stream.LocalListener({"Step": service.local_step}, config.max_message_bytes)
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(service, server)
    return server, port, service


def metric_samples(service: KVCacheService):
    """Prometheus samples (services.metrics.Sample) read at scrape time."""
    st = service.manager.stats()
    return [
        ("pagoda:kv_cache_total_blocks", "KV blocks in the pool.", "gauge", st.num_blocks),
        ("pagoda:kv_cache_used_blocks", "KV blocks in use.", "gauge", st.num_used_blocks),
        (
            "pagoda:kv_cache_free_blocks",
            "KV blocks free (evictable cached ones included).",
            "gauge",
            st.num_free_blocks + st.num_evictable_blocks,
        ),
        ("pagoda:kv_cache_cached_blocks", "KV blocks holding a cached prefix.", "gauge", st.num_cached_blocks),
        (
            "pagoda:kv_cache_usage_perc",
            "Fraction of KV blocks in use.",
            "gauge",
            st.num_used_blocks / max(1, st.num_blocks),
        ),
        (
            "pagoda:kv_cache_internal_fragmentation",
            "Empty slots in used blocks over their slots.",
            "gauge",
            st.internal_fragmentation,
        ),
        (
            "pagoda:kv_cache_external_fragmentation",
            "1 - largest free extent / free blocks.",
            "gauge",
            st.external_fragmentation,
        ),
        (
            "pagoda:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            "counter",
            st.num_prefix_query_tokens,
        ),
        ("pagoda:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter", st.num_prefix_hit_tokens),
        ("pagoda:kv_cache_evictions", "Cached blocks evicted.", "counter", st.num_evictions),
        ("pagoda:kv_cache_copy_on_writes", "Blocks copied on write.", "counter", st.num_copy_on_write),
        ("pagoda:kv_cache_sequences", "Sequences holding blocks.", "gauge", st.num_sequences),
    ]


async def serve(config: KVCacheConfig, ready_file: str | None = None, metrics_port: int | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then stop cleanly."""
    server, port, service = create_server(config)
    await server.start()
    await service.start()
    if metrics_port is not None:
        from services.metrics import serve_metrics

        serve_metrics(metrics_port, config.host, lambda: metric_samples(service), {"service": "kvcache"})
    log.info(
        "KV cache serving on %s:%d, epoch %d: %d blocks of %d, watermark %d blocks, prefix caching %s",
        config.host,
        port,
        service.epoch,
        config.num_blocks,
        config.block_size,
        service.manager.watermark_blocks,
        "on" if config.enable_prefix_caching else "off",
    )
    await serve_until_signalled(port=port, ready_file=ready_file)
    log.info("KV cache stopping")
    await service.stop()
    await server.stop(grace=2.0)
