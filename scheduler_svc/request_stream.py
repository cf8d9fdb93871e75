"""`Scheduler.GenerateStream`: the gateway's one stream to a scheduler, many requests on it
(issue 37: a control plane that costs a fraction of a step).

With `Generate` every request has a call of its own, and every step sends one message down
each: at 32 requests in flight, 32 writes (and 32 reads at the gateway) per step. Here the
gateway sends `StreamCommand`s (a request, or an abort) on one stream, and each request's
outputs are pumped into one outbox that a single writer drains: everything ready at once goes
out as one `StreamEvents` message — one write per step for the whole batch.

Per request the semantics are `Generate`'s: the same admission (`SchedulerService.admit`), the
same responses, its end marked by the response carrying `usage`, or by a `RequestFailure` with
the status `Generate` would have ended with. An abort command without an index ends the
request's entry; the stream ending (the gateway went) aborts every request still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

import grpc

from services.pb import scheduler_pb2

log = logging.getLogger(__name__)


class Refused(Exception):
    """A request not admitted, with the status its call ends with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Admitting(Protocol):
    """What a stream needs of the scheduler's servicer (scheduler_svc/server.py)."""

    engine: Any

    async def admit(self, request: scheduler_pb2.GenerateRequest, traceparent: str = "") -> tuple[Any, Any]: ...

    def failure(self, request_id: str, error: tuple[str, str]) -> scheduler_pb2.RequestFailure: ...

    def responses(self, req: Any, out: Any) -> list[scheduler_pb2.GenerateResponse]: ...


class RequestStream:
    """One GenerateStream call: its commands read by one task, one pump task per request,
    one writer (`run`, the call's response iterator)."""

    def __init__(self, service: Admitting) -> None:
        self.service = service
        self._outbox: asyncio.Queue = asyncio.Queue()  # GenerateResponse | RequestFailure | None (the end)
        self._pumps: dict[str, asyncio.Task] = {}

    async def run(self, commands):
        reader = asyncio.get_running_loop().create_task(self._read(commands))
        try:
            while True:
                item = await self._outbox.get()
                if item is None:
                    return
                events = scheduler_pb2.StreamEvents()
                self._add(events, item)
                while not self._outbox.empty():  # everything ready now: one message
                    item = self._outbox.get_nowait()
                    if item is None:
                        yield events
                        return
                    self._add(events, item)
                yield events
        finally:
            reader.cancel()
            pumps = list(self._pumps.values())
            for task in pumps:
                task.cancel()  # each pump's stream, closed, aborts its request
            for task in [reader, *pumps]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    @staticmethod
    def _add(events: scheduler_pb2.StreamEvents, item) -> None:
        if isinstance(item, scheduler_pb2.RequestFailure):
            events.failures.append(item)
        else:
            events.responses.append(item)

    async def _read(self, commands) -> None:
        try:
            async for command in commands:
                which = command.WhichOneof("command")
                if which == "generate":
                    self._start(command.generate)
                elif which == "abort":
                    self._abort(command.abort)
        except Exception as exc:  # noqa: BLE001 - the gateway went: its requests are aborted
            log.debug("request stream ended: %s", exc)
        finally:
            self._outbox.put_nowait(None)  # the gateway sends no more: the stream ends

    def _start(self, request: scheduler_pb2.GenerateRequest) -> None:
        rid = request.request_id
        if rid and rid in self._pumps:
            self._fail(rid, grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {rid!r} is already live on this stream")
            return
        task = asyncio.get_running_loop().create_task(self._pump(request))
        if rid:
            self._pumps[rid] = task
            task.add_done_callback(lambda _t, rid=rid: self._pumps.pop(rid, None))

    def _abort(self, abort: scheduler_pb2.AbortRequest) -> None:
        if abort.HasField("index"):
            self.service.engine.abort(abort.request_id, abort.index)
            return
        task = self._pumps.pop(abort.request_id, None)
        if task is not None:
            task.cancel()  # its stream closed aborts it; nothing more is sent for it
        else:
            self.service.engine.abort(abort.request_id)

    def _fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self._outbox.put_nowait(
            scheduler_pb2.RequestFailure(request_id=request_id, code=code.value[0], message=message)
        )

    async def _pump(self, request: scheduler_pb2.GenerateRequest) -> None:
        service = self.service
        try:
            req, stream = await service.admit(request)
        except Refused as exc:
            self._fail(request.request_id, exc.code, exc.message)
            return
        try:
            async for out in stream:
                if out.error is not None:
                    self._outbox.put_nowait(service.failure(req.request_id, out.error))
                    return
                for msg in service.responses(req, out):
                    self._outbox.put_nowait(msg)
        finally:
            await stream.aclose()  # an abort or the stream's end aborts the request here
