"""The sender: hands each computed micro-batch (its plan, and its hidden states on the data plane)
to the next stage while the following one computes; the message goes on the next stage's local
socket when it is on this host (services/local_stream.py), else on a gRPC Forward stream. A
broken stream fails the micro-batches it could not take with UNAVAILABLE, and the next one opens
another (a restarted stage has a new epoch)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import grpc

from services import local_stream
from services.grpc_utils import aio_channel
from services.local_stream import LocalCall, LocalStreamError
from services.pb import worker_pb2_grpc
from worker_svc.execution.data_plane import DataPlaneOut
from worker_svc.service.statistics import StageStatistics
from worker_svc.service.work import Work, describe, shared_bytes

log = logging.getLogger(__name__)


class Downstream:
    def __init__(
        self,
        stage: int,
        next_address: str,
        data_out: DataPlaneOut,
        max_message_bytes: int,
        stats: StageStatistics,
        report_failure: Callable[[Work], None],
    ) -> None:
        self.stage, self.next_address, self.data_out = stage, next_address, data_out
        self.max_message_bytes = max_message_bytes
        self.stats = stats
        self.report_failure = report_failure  # a micro-batch not handed on: its error event
        self.queue: asyncio.Queue[Work] = asyncio.Queue()
        self._room = threading.Semaphore(64)  # micro-batches handed to the sender, not yet sent
        self._direct = local_stream.DirectWrites()  # the step thread's own sends, in order with the loop's
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the compute loop starts
        self.connected = False
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._watch_task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        self._channel = aio_channel(self.next_address, self.max_message_bytes)
        return asyncio.create_task(self._send_loop(), name="sender")

    async def stop(self) -> None:
        if self._watch_task:
            self._watch_task.cancel()
        if self._channel is not None:
            await self._channel.close()

    def submit(self, work: Work) -> None:
        """The step thread: a computed micro-batch handed on. Straight onto the next stage's
        local socket when nothing waits before it and its hidden states are in place;
        otherwise to the sender on the event loop (a stream to open, a full ring to wait
        for, gRPC), waiting while 64 are there (back-pressure: the stage computes no further
        ahead)."""
        call = self._call
        if self._direct.take(call, lambda: self.data_out.placed(work.out_hidden, work.mb)):
            self._send_now(call, work)
            return
        self._room.acquire()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, work)

    def _send_now(self, call: LocalCall, work: Work) -> None:
        mb = work.mb
        mb.stage_index = self.stage + 1
        work.out_hidden = None
        mb.sent_ns = time.time_ns()
        size = mb.ByteSize()
        if size > self.max_message_bytes:
            work.error = self._too_large(mb, size)
            self.loop.call_soon_threadsafe(self.report_failure, work)
            return
        try:
            call.send_now(mb)
        except LocalStreamError as exc:
            work.error = self._unavailable(exc)
            self.loop.call_soon_threadsafe(self._failed_now, call, work)
            return
        work.forwarded_ns = time.time_ns()
        self.stats.num_sent_bytes += size + shared_bytes(mb)  # (no send on the loop meanwhile)

    def _failed_now(self, call, work: Work) -> None:
        if self._call is call:
            self._drop_call()
        self.report_failure(work)

    def _unavailable(self, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        return grpc.StatusCode.UNAVAILABLE, f"next stage at {self.next_address} is unavailable: {describe(exc)}"

    def _too_large(self, mb, size: int) -> tuple[grpc.StatusCode, str]:
        return (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"micro-batch {mb.micro_batch_id} is {size} bytes, over the {self.max_message_bytes}-byte "
            "message limit: lower max_num_batched_tokens",
        )

    async def _send_loop(self) -> None:
        while True:
            work = await self.queue.get()
            try:
                await self._send_one(work)
            finally:
                self._direct.written()
                self._room.release()

    async def _send_one(self, work: Work) -> None:
        work.mb.stage_index = self.stage + 1
        try:
            await self._send(work)
        except Exception as exc:  # noqa: BLE001 - any failure of the stream (or its ring) means the same
            self._drop_call()
            work.out_hidden = None
            work.error = self._unavailable(exc)
        if work.error is not None:
            self.report_failure(work)

    async def _send(self, work: Work) -> None:
        mb = work.mb
        call = await self._ensure_call()
        await self.data_out.place(work.out_hidden, mb)  # a full ring waits here: back-pressure
        work.out_hidden = None
        mb.sent_ns = time.time_ns()
        size = mb.ByteSize()
        if size > self.max_message_bytes:
            work.error = self._too_large(mb, size)
            return
        await call.write(mb)
        work.forwarded_ns = time.time_ns()
        self.stats.num_sent_bytes += size + shared_bytes(mb)

    async def _ensure_call(self):
        if self._call is None:
            await asyncio.wait_for(self._channel.channel_ready(), timeout=2.0)
            stub = worker_pb2_grpc.StageWorkerStub(self._channel)
            await self.data_out.connect(stub)  # the channel for hidden states: a ring offered anew
            local = None
            if self.data_out.setting != "grpc":  # the step messages on the next stage's socket, on this host
                local = await local_stream.try_open(stub, "Forward", max_message_bytes=self.max_message_bytes)
            self._call = local or stub.Forward()
            self.stats.control_channel = "unix" if local else "grpc"
            self._watch_task = asyncio.create_task(self._watch(self._call), name="downstream")
            self.connected = True
        return self._call

    def _drop_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = None
        self.connected = False
        self.data_out.drop()

    async def _watch(self, call) -> None:
        """The stream to the next stage sends nothing back until it ends: its end (an error,
        or the next stage gone) drops it, and the next micro-batch opens another."""
        try:
            await call
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.warning("stream to next stage %s broke: %s", self.next_address, describe(exc))
        except asyncio.CancelledError:
            return
        if self._call is call:
            self._call = None
            self.connected = False
            self.data_out.drop()
