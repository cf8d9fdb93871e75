"""The scheduler's gRPC transport to the pipeline.

One long-lived `Forward` stream into stage 0 carries micro-batches; one `Events` stream
from every stage brings results straight back: any stage's errors, and from the last stage
each step's sampled tokens with every stage's timing. No stage dials the scheduler: a
broken events stream tells the scheduler at once which stage is gone. A stage on this host
offers a local socket for those streams (services/local_stream.py): they take it, the same
messages at a fraction of gRPC's cost; everything else stays on gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace

import grpc

from scheduler_svc.core.lora import LoraAdapter, LoraRegistry
from scheduler_svc.events import ErrorEvent, StageDownEvent, StageInfo
from services import local_stream
from services.grpc_utils import aio_channel, status_from_value
from services.pb import worker_pb2, worker_pb2_grpc
from services.step import StageTiming, StepPlan
from services.step_codec import PlanDecodeError, plan_to_pb, result_from_pb

log = logging.getLogger(__name__)


FEEDBACK_WAIT_S = 5.0  # how long a connect waits for the last stage's feedback stream to open
# a stage's answers that mean it is gone, not that it refused
_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _info(address: str, li: worker_pb2.StageLoadInfo, feedback: bool = False) -> StageInfo:
    return StageInfo(
        stage_index=li.stage_index,
        num_stages=li.num_stages,
        epoch=li.epoch,
        layer_start=li.layer_start,
        layer_end=li.layer_end,
        num_layers=li.num_layers,
        num_kv_blocks=li.num_kv_blocks,
        block_size=li.block_size,
        vocab_size=li.vocab_size,
        address=address,
        feedback=feedback,
        weights_bytes=li.weights_bytes,
        quantization=li.quantization,
        expert_weights_bytes=li.expert_weights_bytes,
        kv_block_bytes=li.kv_block_bytes,
        kv_cache_dtype=li.kv_cache_dtype,
        memory_budget_bytes=li.memory_budget_bytes,
        device=li.device,
        cpu=li.cpu,
        kv_groups=li.kv_groups,
    )


class GrpcStageTransport:
    def __init__(self, addresses: list[str], max_message_bytes: int = 256 << 20) -> None:
        if not addresses:
            raise ValueError("stages: at least one stage address is needed")
        self.addresses = addresses
        self.max_message_bytes = max_message_bytes
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[worker_pb2_grpc.StageWorkerStub] = []
        self._tasks: list[asyncio.Task] = []
        self._forward = None
        self._in_flight: set[int] = set()  # steps sent on this connection, no outcome yet
        self._last_sent = 0
        self.infos: list[StageInfo] = []
        self._last_load_info = worker_pb2.StageLoadInfo()
        self._lora_turn = asyncio.Lock()  # LoRA loads, unloads and syncs, one at a time
        # how the step's streams go: "unix" (services/local_stream.py) or "grpc"
        self.forward_channel = ""
        self.events_channels: list[str] = []  # one per stage
        self._connection = 0  # counts closes: a stream opened for an older connection is dropped

    async def connect(self, on_event: Callable[[object], None], timeout_s: float = 30.0) -> list[StageInfo]:
        await self.close()
        self._channels = [aio_channel(a, self.max_message_bytes) for a in self.addresses]
        self._stubs = [worker_pb2_grpc.StageWorkerStub(c) for c in self._channels]
        self.events_channels = [""] * len(self.addresses)
        ready: list[asyncio.Future] = [asyncio.get_running_loop().create_future() for _ in self.addresses]
        for i in range(len(self.addresses)):
            self._tasks.append(asyncio.create_task(self._read_events(i, on_event, ready[i])))
        try:
            infos = await asyncio.wait_for(asyncio.gather(*ready), timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            await self.close()
            raise ConnectionError(f"stages not ready: {exc}") from exc
        self._check_chain(infos)
        if len(infos) > 1 and await self._feedback_open(infos):
            infos = [replace(info, feedback=True) for info in infos]
        self.infos = infos
        local = await local_stream.try_open(self._stubs[0], "Forward", max_message_bytes=self.max_message_bytes)
        self._forward = local or self._stubs[0].Forward()
        self.forward_channel = "unix" if local else "grpc"
        self._tasks.append(asyncio.create_task(self._watch_forward(self._forward, on_event)))
        return infos

    def _check_chain(self, infos: list[StageInfo]) -> None:
        n = len(self.addresses)
        expected_start = 0
        for i, info in enumerate(infos):
            if info.stage_index != i or info.num_stages != n:
                raise ValueError(
                    f"{self.addresses[i]} is stage {info.stage_index} of {info.num_stages}, expected stage {i} of {n}"
                )
            if info.layer_start != expected_start:
                raise ValueError(f"stage {i} starts at layer {info.layer_start}, expected {expected_start}")
            expected_start = info.layer_end
        if expected_start != infos[-1].num_layers:
            raise ValueError(f"the stages cover layers up to {expected_start} of {infos[-1].num_layers}")

    async def _feedback_open(self, infos: list[StageInfo]) -> bool:
        """Whether the last stage streams sampled tokens to this first stage (started with
        --feedback pointing at it, and the stream open: waited for a few seconds at start)."""
        last = self._last_load_info
        if not last.feedback_address:
            return False
        deadline = asyncio.get_running_loop().time() + FEEDBACK_WAIT_S
        while True:
            first = await self._stubs[0].LoadInfo(worker_pb2.LoadInfoRequest(), timeout=2.0)
            if first.epoch == infos[0].epoch and first.feedback_connected:
                return True
            if asyncio.get_running_loop().time() > deadline:
                log.warning(
                    "the last stage feeds %s, but no feedback stream is open on the first "
                    "stage %s: the scheduler sends it the sampled tokens",
                    last.feedback_address,
                    self.addresses[0],
                )
                return False
            await asyncio.sleep(0.05)

    async def abandon(self, seq_ids: list[int]) -> None:
        if not self._stubs or not self.infos:
            return
        request = worker_pb2.AbandonRequest(epoch=self.infos[0].epoch, seq_ids=seq_ids)
        await self._stubs[0].Abandon(request, timeout=2.0)

    # --- multi-LoRA: the stages hold the registry's adapters ------------------------------
    # Loads, unloads and the sync after a connect take turns (`_lora_turn`): a sync reads
    # what the stages hold now, and no load changes it under the sync's feet.

    async def load_lora(self, adapter: LoraAdapter, registry: LoraRegistry, timeout_s: float = 120.0) -> None:
        """Loads an adapter on every stage, first to last, and registers it. ValueError when
        the registry has the name already; a load one stage refuses is unloaded from those
        that took it, and its error (grpc.aio.AioRpcError) raised. A stage holding the name
        holds a stale copy (the registry has no such adapter): it is replaced."""
        async with self._lora_turn:
            if registry.get(adapter.name) is not None:
                raise ValueError(f"lora_name: an adapter {adapter.name!r} is loaded already")
            done: list[worker_pb2_grpc.StageWorkerStub] = []
            try:
                for stub in self._stubs:
                    await self._load_one(stub, adapter, timeout_s)
                    done.append(stub)
            except grpc.aio.AioRpcError:
                for stub in done:
                    await self._unload_one(stub, adapter.name, timeout_s)
                raise
            registry.add(adapter)

    async def unload_lora(self, name: str, registry: LoraRegistry, timeout_s: float = 120.0) -> None:
        """Unloads an adapter from every stage and from the registry. A stage that does not
        hold it, or cannot be reached, is passed over: a stage that comes back holding it is
        put right by the sync after the reconnect, a stale copy by the next load of the name."""
        async with self._lora_turn:
            try:
                for stub in self._stubs:
                    await self._unload_one(stub, name, timeout_s)
            finally:
                registry.remove(name)

    async def sync_loras(self, registry: LoraRegistry, timeout_s: float = 120.0) -> list[str]:
        """After a connect: every stage is made to hold exactly the registry's adapters (a
        restarted stage holds only those of --lora-modules). An adapter a stage cannot load
        again (its folder is gone) is unloaded from every stage and dropped from the
        registry: its name is returned, for its requests to end. ConnectionError when a
        stage cannot be reached (the connect is tried again)."""
        async with self._lora_turn:
            try:
                infos = [await stub.LoadInfo(worker_pb2.LoadInfoRequest(), timeout=timeout_s) for stub in self._stubs]
                plans = registry.sync(
                    [[LoraAdapter(a.lora_name, a.lora_path, a.load_id) for a in info.lora_adapters] for info in infos]
                )
                failed: dict[str, str] = {}
                for i, (stub, plan) in enumerate(zip(self._stubs, plans, strict=True)):
                    for name in plan.unload:
                        await self._unload_one(stub, name, timeout_s, quiet=False)
                    for adapter in plan.load:
                        if adapter.name in failed:
                            continue
                        try:
                            await self._load_one(stub, adapter, timeout_s)
                        except grpc.aio.AioRpcError as exc:
                            if exc.code() in _DOWN:
                                raise
                            failed[adapter.name] = f"stage {i}: {exc.details()}"
                for name, why in failed.items():
                    log.error("LoRA adapter %r could not be loaded again (%s): dropped from every stage", name, why)
                    for stub in self._stubs:
                        await self._unload_one(stub, name, timeout_s, quiet=False)
                    registry.remove(name)
                if any(not plan.empty for plan in plans):
                    log.info("LoRA adapters synced to the stages: %s", [a.name for a in registry.adapters])
                return list(failed)
            except grpc.aio.AioRpcError as exc:
                raise ConnectionError(f"LoRA adapters not synced: {exc.code().name}: {exc.details()}") from exc

    async def _load_one(self, stub, adapter: LoraAdapter, timeout_s: float) -> None:
        request = worker_pb2.LoraAdapterRequest(lora_name=adapter.name, lora_path=adapter.path, load_id=adapter.load_id)
        try:
            await stub.LoadLoraAdapter(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            await stub.UnloadLoraAdapter(request, timeout=timeout_s)
            await stub.LoadLoraAdapter(request, timeout=timeout_s)

    async def _unload_one(self, stub, name: str, timeout_s: float, quiet: bool = True) -> None:
        """Unload `name` from one stage; one that does not hold it is fine. Any other refusal
        is logged (`quiet`) or raised."""
        try:
            await stub.UnloadLoraAdapter(worker_pb2.LoraAdapterRequest(lora_name=name), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return
            if not quiet:
                raise
            log.warning("unloading LoRA adapter %r from a stage failed: %s %s", name, exc.code().name, exc.details())

    async def _read_events(self, index: int, on_event, ready: asyncio.Future) -> None:
        last, connection, stream = index == len(self.addresses) - 1, self._connection, None
        try:
            request = worker_pb2.EventsRequest(subscriber="scheduler")
            stream = await local_stream.try_open(
                self._stubs[index], "Events", request, worker_pb2.StageEvent, self.max_message_bytes
            )
            if connection != self._connection:  # closed meanwhile (a cancellation lost in the open)
                return
            self.events_channels[index] = "grpc" if stream is None else "unix"
            if stream is None:
                stream = self._stubs[index].Events(request, wait_for_ready=False)
            async for event in stream:
                if event.HasField("ready"):
                    if not ready.done():
                        if last:
                            self._last_load_info = event.ready
                        ready.set_result(_info(self.addresses[index], event.ready))
                    continue
                self._handle_done(index, event.done, on_event)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if not ready.done():
                ready.set_exception(exc)
                return
            on_event(StageDownEvent(index, f"{exc.code().name}: {exc.details()}"))
            return
        finally:
            if stream is not None:
                stream.cancel()  # (the stage sees its subscriber go)
        if not ready.done():
            ready.set_exception(ConnectionError(f"stage {index} closed its event stream"))
        else:
            on_event(StageDownEvent(index, "event stream ended"))

    def _handle_done(self, index: int, done: worker_pb2.MicroBatchDone, on_event) -> None:
        """One stage's outcome of a step. Only steps this connection sent and that are still
        in flight count: anything else (a stage's bug, a stale or forged id) is dropped, so
        it cannot move the order of results on (issue 16: an id of 2**64 - 1 once made every
        later result look too late)."""
        mb_id = done.micro_batch_id
        if mb_id not in self._in_flight:
            if mb_id > self._last_sent:  # (a late report of a step already ended: quietly)
                log.warning("stage %d reported micro-batch %d, which was never sent: ignored", index, mb_id)
            return
        if done.HasField("error") and done.error.code:
            code = status_from_value(done.error.code).name
            self._in_flight.discard(mb_id)
            on_event(ErrorEvent(mb_id, index, code, done.error.message))
            return
        if index != len(self.addresses) - 1:
            return  # (a stage that reports its successes too: the last one brings its timing)
        self._in_flight.discard(mb_id)
        timings = tuple(
            StageTiming(t.stage_index, t.received_ns, t.compute_start_ns, t.compute_end_ns)
            for t in (*done.upstream_timings, done.timing)
        )
        try:
            result = result_from_pb(done, timings)
        except PlanDecodeError as exc:  # a malformed report fails its step, not the connection
            on_event(ErrorEvent(mb_id, index, grpc.StatusCode.INTERNAL.name, str(exc)))
            return
        on_event(result)

    async def _watch_forward(self, call, on_event) -> None:
        """The stream into stage 0 answers only when it ends: an end that is not ours is a
        stage gone."""
        try:
            await call
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                on_event(StageDownEvent(0, f"forward stream: {exc.code().name}: {exc.details()}"))

    async def submit(self, plan: StepPlan) -> None:
        if self._forward is None:
            raise ConnectionError("not connected")
        self._in_flight.add(plan.step_id)
        self._last_sent = max(self._last_sent, plan.step_id)
        await self._forward.write(plan_to_pb(plan))

    async def stage_stats(self, timeout_s: float = 1.0) -> list[dict]:
        """Every stage's statistics, asked of all at once: a hung stage shows as not
        healthy after `timeout_s` instead of holding up the answer (the gateway's own
        deadline for the scheduler's statistics is 2 s)."""

        async def one(i: int, stub) -> dict:
            try:
                s = await stub.GetStats(worker_pb2.StageStatsRequest(), timeout=timeout_s)
                return {"stage_index": i, "address": self.addresses[i], "healthy": True, "stats": s}
            except grpc.aio.AioRpcError as exc:
                return {
                    "stage_index": i,
                    "address": self.addresses[i],
                    "healthy": False,
                    "error": f"{exc.code().name}: {exc.details()}",
                }

        return list(await asyncio.gather(*(one(i, stub) for i, stub in enumerate(self._stubs))))

    async def pull_blocks(
        self, sources: list[str], seq_id: int, indices: list[int], keys: list[bytes], timeout_s: float
    ) -> list[worker_pb2.PullBlocksReply | BaseException]:
        """P/D: stage k pulls blocks `indices` of sequence `seq_id` from `sources[k]` (the
        prefill replica's stage k) under `keys`, every stage at once; each stage's reply or
        its error, once every stage answered (so a failure's clean-up follows every pull)."""

        async def one(stub, source: str):
            request = worker_pb2.PullBlocksRequest(
                source_address=source, seq_id=seq_id, block_indices=indices, keys=keys, timeout_s=timeout_s
            )
            return await stub.PullBlocks(request, timeout=timeout_s + 5.0)

        pulls = (one(stub, source) for stub, source in zip(self._stubs, sources, strict=True))
        return list(await asyncio.gather(*pulls, return_exceptions=True))

    async def close(self) -> None:
        self._connection += 1
        self._in_flight.clear()
        if self._forward is not None:
            self._forward.cancel()
            self._forward = None
        for task in self._tasks:
            task.cancel()
        if self._tasks:  # (bounded: a task that lost its cancellation must not hold the reconnect)
            _, stuck = await asyncio.wait(self._tasks, timeout=5.0)
            for task in stuck:
                log.warning("a stage stream's task did not end when cancelled: %s", task.get_name())
        self._tasks = []
        for channel in self._channels:
            await channel.close()
        self._channels, self._stubs = [], []
