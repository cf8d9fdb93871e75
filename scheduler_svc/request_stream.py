"""`Scheduler.GenerateStream`: the gateway's one stream to a scheduler, many requests on it
(issue 37: a control plane that costs a fraction of a step).

With `Generate` every request has a call of its own, and every step sends one message down
each: at 32 requests in flight, 32 writes (and 32 reads at the gateway) per step. Here the
gateway sends `StreamCommand`s (a request, or an abort) on one stream, and the engine puts
each request's outputs, as responses, straight into one outbox (`_Outputs`: no task per request
wakes per step) that a single writer drains: everything ready at once goes out as one
`StreamEvents` message — one write per step for the whole batch. A task per request runs only
its admission.

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

    async def admit(
        self, request: scheduler_pb2.GenerateRequest, traceparent: str = "", sink: Any = None
    ) -> tuple[Any, Any]: ...

    def failure(self, request_id: str, error: tuple[str, str]) -> scheduler_pb2.RequestFailure: ...

    def responses(self, req: Any, out: Any) -> list[scheduler_pb2.GenerateResponse]: ...


class _Outputs:
    """One admitted request's outputs, turned into responses in the stream's outbox as the
    engine makes them (the engine's `OutputSink`); closed by its last output or an error, or
    when the stream no longer wants them (the request is aborted then)."""

    def __init__(self, stream: RequestStream, request_id: str) -> None:
        self.stream, self.request_id = stream, request_id
        self.req = None  # the engine's request, set as its admission returns
        self.closed = False

    def put_nowait(self, out) -> None:
        if self.closed:
            return
        stream = self.stream
        if out.error is not None:
            stream._outbox.put_nowait(stream.service.failure(self.request_id, out.error))
            self.close()
            return
        try:
            msgs = stream.service.responses(self.req, out)
        except Exception as exc:  # (a bug) this request fails, not the engine's loop that called
            log.exception("request %s: its output could not be sent", self.request_id)
            msgs = [stream.service.failure(self.request_id, ("INTERNAL", f"{type(exc).__name__}: {exc}"))]
            self.abort()
        for msg in msgs:
            stream._outbox.put_nowait(msg)
        if out.finished:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self.stream._outputs.get(self.request_id) is self:
            del self.stream._outputs[self.request_id]

    def abort(self) -> None:
        """The stream's consumer went, or aborted the request: no more is sent for it."""
        if not self.closed:
            self.close()
            if self.req is not None and self.req.state.is_live:
                self.stream.service.engine.abort(self.request_id)


class RequestStream:
    """One GenerateStream call: its commands read by one task, a task per request while it
    is admitted, its outputs put into the outbox by the engine, one writer (`run`, the
    call's response iterator)."""

    def __init__(self, service: Admitting) -> None:
        self.service = service
        self._outbox: asyncio.Queue = asyncio.Queue()  # GenerateResponse | RequestFailure | None (the end)
        self._pumps: dict[str, asyncio.Task] = {}  # admissions under way
        self._outputs: dict[str, _Outputs] = {}  # admitted requests still running

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
                task.cancel()  # an admission under way goes no further
            for outputs in list(self._outputs.values()):
                outputs.abort()  # the gateway went: its requests end
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
        if rid and (rid in self._pumps or rid in self._outputs):
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
        outputs = self._outputs.get(abort.request_id)
        if outputs is not None:  # admitted (its task may be done, its entry not yet gone)
            outputs.abort()  # nothing more is sent for it
        elif task is not None and not task.done():
            task.cancel()  # its admission goes no further
        else:
            self.service.engine.abort(abort.request_id)

    def _fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self._outbox.put_nowait(
            scheduler_pb2.RequestFailure(request_id=request_id, code=code.value[0], message=message)
        )

    async def _pump(self, request: scheduler_pb2.GenerateRequest) -> None:
        """The request's admission; from then the engine puts its outputs in (`_Outputs`)."""
        outputs = _Outputs(self, request.request_id)
        try:
            req, _ = await self.service.admit(request, sink=outputs)
        except Refused as exc:
            self._fail(request.request_id, exc.code, exc.message)
            return
        # (no await between the engine's taking it and here: nothing is put in before this)
        outputs.req, outputs.request_id = req, req.request_id
        if not outputs.closed:
            self._outputs[req.request_id] = outputs
