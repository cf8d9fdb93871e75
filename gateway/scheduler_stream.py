"""The gateway's one stream per scheduler (`Scheduler.GenerateStream`, issue 37).

Every request this gateway sends to a replica rides one long-lived bidirectional stream
instead of a `Generate` call of its own: a request (or an abort) goes out as a
`StreamCommand`, and each step's responses for all requests come back as one `StreamEvents`
message, which one reader task hands out to the requests' queues. `SchedulerStream.generate`
returns a `StreamedCall` that behaves as the `Generate` call it stands for (what
`TextGenerator.scheduler_responses` uses of one): iterated for the request's responses, ended
by the one carrying `usage`; its failure raised as the `grpc.aio.AioRpcError` the call would
have raised (code, details, the pipeline-down trailing metadata); `cancel()` aborts the
request downstream; `done()`.

On one host the stream takes the scheduler's local socket (`LocalEndpoint`,
services/local_stream.py): the same messages, framed, at a fraction of gRPC's CPU per step
at both ends; a scheduler that offers none (`--request-channel grpc`, or another host) gets
the gRPC call.

The stream breaking (the scheduler died, or restarted) fails every request on it UNAVAILABLE,
as their own calls would have failed; the next request opens a new stream. A scheduler that
does not know the call (UNIMPLEMENTED) is sent `Generate` calls from then on.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services import local_stream
from services.grpc_utils import DEFAULT_MAX_MESSAGE_BYTES, PIPELINE_DOWN, UNAVAILABLE_REASON_KEY, status_from_value
from services.pb import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)

_END = object()


def call_error(code: grpc.StatusCode, details: str, pipeline_down: bool = False) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((UNAVAILABLE_REASON_KEY, PIPELINE_DOWN)) if pipeline_down else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


class SchedulerStream:
    """One scheduler's stream, opened on first use and again after it broke."""

    def __init__(self, stub, max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._stub = stub
        self._max_message_bytes = max_message_bytes  # None: gRPC only
        self._call = None  # the open GenerateStream call (a gRPC call, or a local_stream.LocalCall)
        self._open_lock = asyncio.Lock()
        self.channel = ""  # how the last stream opened went: "unix" (the scheduler's local socket) or "grpc"
        self._reader: asyncio.Task | None = None
        self._queues: dict[str, tuple[object, asyncio.Queue]] = {}  # request id -> (its call, its queue)
        self._write_lock = asyncio.Lock()
        self._aborts: set[asyncio.Task] = set()  # abort commands being written (held: the loop keeps weak refs)
        self.unsupported = False  # the scheduler answered UNIMPLEMENTED: Generate calls instead
        self.num_streams = 0  # streams opened (1 while nothing broke)

    def generate(self, request: scheduler_pb2.GenerateRequest) -> StreamedCall:
        return StreamedCall(self, request)

    async def _open(self):
        if self._call is not None:
            return self._call
        async with self._open_lock:  # (the first requests all wait for the one stream)
            if self._call is None:
                local = await self._open_local()
                self._call = local or self._stub.GenerateStream()
                self.channel = "unix" if local is not None else "grpc"
                self.num_streams += 1
                self._reader = asyncio.get_running_loop().create_task(self._read(self._call))
        return self._call

    async def _open_local(self):
        """The stream on the scheduler's local socket, when it offers one and it answers
        (this host); None: the gRPC call instead."""
        if self._max_message_bytes is None or not hasattr(self._stub, "LocalEndpoint"):
            return None
        try:
            info = await self._stub.LocalEndpoint(common_pb2.LocalEndpointRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:  # (an older scheduler: UNIMPLEMENTED)
            return None
        return await local_stream.open_offered(
            info.local_socket,
            info.local_token,
            "GenerateStream",
            "the scheduler",
            response_type=scheduler_pb2.StreamEvents,
            max_message_bytes=self._max_message_bytes,
        )

    async def send(self, request: scheduler_pb2.GenerateRequest) -> asyncio.Queue:
        """Start `request` on the stream: the queue its responses (and end) arrive on."""
        rid = request.request_id
        if rid in self._queues:
            raise call_error(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {rid!r} is already live on this stream")
        call = await self._open()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (call, queue)
        try:
            async with self._write_lock:
                await call.write(scheduler_pb2.StreamCommand(generate=request))
        except Exception as exc:  # (a call that ended meanwhile: asyncio.InvalidStateError, UsageError...)
            self._queues.pop(rid, None)
            error = exc if isinstance(exc, grpc.aio.AioRpcError) else None
            if error is None or error.code() == grpc.StatusCode.CANCELLED:
                error = call_error(grpc.StatusCode.UNAVAILABLE, f"the scheduler's stream broke: {exc}")
            self._fail_all(call, error)  # (its other requests too: each is retried as unstreamed)
            call.cancel()
            raise error from None
        return queue

    def abort(self, request_id: str) -> None:
        """The caller stopped reading `request_id`: abort it downstream (in the background)."""
        entry = self._queues.pop(request_id, None)
        if entry is None or entry[0] is not self._call:
            return
        command = scheduler_pb2.StreamCommand(abort=scheduler_pb2.AbortRequest(request_id=request_id))
        task = asyncio.get_running_loop().create_task(self._write(entry[0], command))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def finished(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _write(self, call, command) -> None:
        try:
            async with self._write_lock:
                await call.write(command)
        except Exception as exc:  # noqa: BLE001 - a broken stream aborts everything on it anyway
            log.debug("abort on the scheduler's stream: %s", exc)

    async def _read(self, call) -> None:
        error = call_error(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the stream")
        try:
            async for events in call:
                for resp in events.responses:
                    entry = self._queues.get(resp.request_id)
                    if entry is not None:
                        entry[1].put_nowait(resp)
                for failure in events.failures:
                    entry = self._queues.pop(failure.request_id, None)
                    if entry is not None:
                        code = status_from_value(failure.code)
                        entry[1].put_nowait(call_error(code, failure.message, failure.pipeline_down))
        except grpc.aio.AioRpcError as exc:
            error = exc
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported = True
        except asyncio.CancelledError:
            error = call_error(grpc.StatusCode.CANCELLED, "the gateway closed the stream")
            raise
        finally:
            self._fail_all(call, error)

    def _fail_all(self, call, error: grpc.aio.AioRpcError) -> None:
        if self._call is call:
            self._call = None
        for rid, (c, queue) in list(self._queues.items()):
            if c is call:
                del self._queues[rid]
                queue.put_nowait(error)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


class StreamedCall:
    """One request on a `SchedulerStream`, as its `Generate` call would behave."""

    def __init__(self, stream: SchedulerStream, request: scheduler_pb2.GenerateRequest) -> None:
        self._stream, self._request = stream, request
        self._queue: asyncio.Queue | None = None
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._stream.abort(self._request.request_id)

    def __aiter__(self):
        return self._responses()

    async def _responses(self):
        if self._done:
            return
        self._queue = await self._stream.send(self._request)
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, grpc.aio.AioRpcError):
                    self._done = True
                    raise item
                if item.HasField("usage"):  # the request's last response
                    self._done = True
                    self._stream.finished(self._request.request_id)
                    yield item
                    return
                yield item
        finally:
            self.cancel()  # a caller that stopped early aborts the request
