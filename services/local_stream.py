"""The step's messages between processes on one host, over a Unix socket (issue 37).

The stages' step streams (below), and the gateway's one GenerateStream to a scheduler on
its host (scheduler_svc/server.py offers it, gateway/scheduler_stream.py opens it): each
step's outputs reach the gateway as one framed message, not a gRPC one.

A step crosses the pipeline as a handful of protobuf messages: the plan into stage 0, the
micro-batch from stage to stage, the result back to the scheduler and the sampled tokens
back to stage 0. Over gRPC aio each costs ~0.15 ms of CPU to send and as much to receive
on these cores; over a Unix socket ~0.01 and ~0.04 ms. One hop of the pipeline (the ring for
the hidden states, the message beside it) takes 0.09-0.32 ms p50 with the message on the
socket, 0.38-0.58 ms on gRPC (`python -m bench.stage_handoff`, docs/benchmarks.md). On one
host those streams take a socket instead, carrying
the same protobuf messages, framed; gRPC stays for everything else (loading, statistics,
LoRA, KV transfer) and is the fallback: another host, a stage set to `--stage-channel grpc`,
a socket that does not answer.

- A stage listens on an abstract Unix socket (`LocalListener`: Linux's abstract namespace,
  so nothing is left in the file system however the process ends), a random name and a
  random 16-byte token; both are in its `StageLoadInfo` (`local_socket`, `local_token`), read
  over the authenticated gRPC connection. The dialer opens a stream with a hello (the token
  and the method: "Forward", "Feedback" or "Events"; a scheduler's "GenerateStream"); a wrong token, an unknown method or an
  oversized hello closes the socket.
- The stream then carries frames: a 4-byte little-endian length, a kind byte (a message, or
  the end with a status code and its details) and the body. A message over the limit ends
  the stream (RESOURCE_EXHAUSTED), so does one that does not decode (INVALID_ARGUMENT).
- `LocalCall` is the dialer's side and reads like a gRPC aio call (`write`, `async for`,
  `await call`, `cancel`); its errors are `grpc.aio.AioRpcError`s, so the callers treat a
  socket's end as a stream's end: a peer gone is UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from services.pb import common_pb2, worker_pb2

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<IB")  # body length, kind
_MESSAGE, _END = 0, 1
_END_BODY = struct.Struct("<B")  # the status code's value, then its details (utf-8)
_TOKEN_BYTES = 16
_MAX_HELLO = 256
_HIGH_WATER = 4 << 20  # a writer waits (`drain`) once this much is unsent: back-pressure
_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11's timeout context; None on 3.10
PEER_GONE = "the local stream's peer went"  # the details of a stream whose peer went (a caller matches it)


class LocalStreamError(grpc.aio.AioRpcError):
    """A local stream ended with an error (or its peer went): read as a gRPC call's error,
    with the trailing metadata the handler aborted with."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


class LocalAbort(Exception):
    """A handler's `context.abort`: ends the stream with this status (and trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, tuple(trailing)


def _frame(kind: int, body: bytes) -> bytes:
    return _FRAME.pack(len(body), kind) + body


def _end_frame(code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> bytes:
    """The end: the status code's value, its details, then each trailing "key=value", all
    NUL-separated (details and metadata hold no NUL)."""
    parts = [details.replace("\0", " ").encode()[:4096]]
    parts += [f"{k}={v}".replace("\0", " ").encode()[:1024] for k, v in trailing[:16]]
    return _frame(_END, _END_BODY.pack(code.value[0]) + b"\0".join(parts))


def _status(value: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> tuple[int, bytes]:
    """(kind, body); LocalStreamError when the peer went or the frame is over `limit`."""
    try:
        size, kind = _FRAME.unpack(await reader.readexactly(_FRAME.size))
        if size > limit:
            raise LocalStreamError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"a {size}-byte message, over the {limit}-byte limit"
            )
        return kind, await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise LocalStreamError(grpc.StatusCode.UNAVAILABLE, f"{PEER_GONE} ({exc})") from None


def _decode(message_type, body: bytes):
    try:
        return message_type.FromString(body)
    except Exception:  # noqa: BLE001 - protobuf raises DecodeError or others on garbage
        raise LocalStreamError(
            grpc.StatusCode.INVALID_ARGUMENT, f"a message that does not decode as {message_type.DESCRIPTOR.name}"
        ) from None


# --- the listening side (a stage) -----------------------------------------------------------


class LocalContext:
    """What a servicer's handler uses of a gRPC context."""

    def peer(self) -> str:
        return "unix:local"

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise LocalAbort(code, details, tuple(trailing_metadata))


class ServerStream:
    """One accepted stream, as its handler sees it: the messages that come in, and `write`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int) -> None:
        self._reader, self._writer, self._limit = reader, writer, limit
        self.context = LocalContext()

    async def messages(self, message_type) -> AsyncIterator:
        """The messages the dialer writes, until it ends the stream or goes (both end the
        iteration, as a gRPC request iterator ends)."""
        while True:
            try:
                kind, body = await _read_frame(self._reader, self._limit)
            except LocalStreamError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise LocalAbort(exc.code(), exc.details()) from None
                return
            if kind != _MESSAGE:
                return
            try:
                yield _decode(message_type, body)
            except LocalStreamError as exc:
                raise LocalAbort(exc.code(), exc.details()) from None

    async def write(self, message) -> None:
        self._writer.write(_frame(_MESSAGE, message.SerializeToString()))
        if self._writer.transport.get_write_buffer_size() > _HIGH_WATER:
            await self._writer.drain()

    async def respond(self, request_type, serve: Callable) -> None:
        """A server-streaming method: its one request, then every message of
        `serve(request, context)` written, until the dialer goes (the responses are then
        stopped and closed, as gRPC cancels a stream whose client went)."""
        requests = self.messages(request_type)
        request = await anext(requests, None)
        if request is None:
            return
        responding = asyncio.current_task()
        watch = asyncio.create_task(self._cancel_when_gone(requests, responding), name="local-stream-watch")
        try:
            async with contextlib.aclosing(serve(request, self.context)) as responses:
                async for message in responses:
                    await self.write(message)
        finally:
            watch.cancel()

    @staticmethod
    async def _cancel_when_gone(requests, responding: asyncio.Task) -> None:
        with contextlib.suppress(LocalAbort):
            async for _ in requests:
                pass
        responding.cancel()


Handler = Callable[[ServerStream], Awaitable[None]]


class LocalListener:
    """A stage's abstract Unix socket: streams opened by the dialers of this host, each to
    one of `handlers` (a method name's coroutine)."""

    def __init__(self, handlers: dict[str, Handler], max_message_bytes: int) -> None:
        self.handlers, self.max_message_bytes = handlers, max_message_bytes
        self.name = f"\0pagoda-{secrets.token_hex(12)}"
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self.num_open = 0  # streams open now
        self.num_refused = 0  # hellos refused (a wrong token or method)
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        """The socket's name as StageLoadInfo carries it ("@" for the leading NUL, as `ss` shows)."""
        return "@" + self.name[1:]

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accept, self.name, limit=1 << 16)

    async def close(self) -> None:
        """No more streams; those open are cut (their dialers see the stage gone)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._open):
            writer.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            kind, hello = await _within(5.0, _read_frame(reader, _MAX_HELLO))
            token, method = hello[:_TOKEN_BYTES], hello[_TOKEN_BYTES:].decode(errors="replace")
            handler = self.handlers.get(method)
            if kind != _MESSAGE or not hmac.compare_digest(token, self.token) or handler is None:
                self.num_refused += 1
                log.warning("a local stream was refused (wrong token or method %r)", method[:32])
                writer.write(_end_frame(grpc.StatusCode.UNAUTHENTICATED, "wrong token or method"))
                return
            writer.write(_frame(_MESSAGE, b""))  # accepted
        except (TimeoutError, LocalStreamError):
            return await self._close(writer)
        self.num_open += 1
        self._open.add(writer)
        end = _end_frame(grpc.StatusCode.OK, "")
        try:
            await handler(ServerStream(reader, writer, self.max_message_bytes))
        except LocalAbort as exc:
            end = _end_frame(exc.code, exc.details, exc.trailing)
        except (ConnectionError, asyncio.CancelledError):
            end = b""
        except Exception as exc:  # a handler's bug ends its stream, not the listener
            log.exception("local %s stream failed", method)
            end = _end_frame(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            self.num_open -= 1
            self._open.discard(writer)
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.write(end)
            await self._close(writer)

    @staticmethod
    async def _close(writer: asyncio.StreamWriter) -> None:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
            await writer.wait_closed()


# --- the dialing side (the scheduler, a stage upstream) -------------------------------------


class LocalCall:
    """One stream opened on a stage's socket, used as a gRPC aio streaming call: `write`
    messages (Forward, Feedback), iterate the responses (Events), `await` its end, `cancel`.
    Made by `open_call`."""

    def __init__(self, reader, writer, response_type, limit: int) -> None:
        self._reader, self._writer, self._limit = reader, writer, limit
        self._response_type = response_type
        self._raw: socket.socket | None = None  # `send_now`'s own handle on the socket
        self._ended: asyncio.Future = asyncio.get_running_loop().create_future()
        self._reader_task = None
        if response_type is None:  # nothing comes back but the end: watched from the start
            self._reader_task = asyncio.create_task(self._await_end(), name="local-stream-end")

    async def write(self, message) -> None:
        if self._ended.done():
            raise self._error()
        self._writer.write(_frame(_MESSAGE, message.SerializeToString()))
        if self._writer.transport.get_write_buffer_size() > _HIGH_WATER:
            await self._writer.drain()

    def idle(self) -> bool:
        """Nothing of this stream's is waiting in the event loop's buffer: a `send_now` goes
        out after everything written before it."""
        return not self._ended.done() and self._writer.transport.get_write_buffer_size() == 0

    def send_now(self, message, timeout_s: float = 60.0) -> None:
        """Another thread's write (the stage's step thread), straight to the socket: for a
        caller that writes nothing on the event loop meanwhile (it checks `idle` first).
        Waits while the socket's buffer is full (back-pressure), up to `timeout_s`;
        LocalStreamError (UNAVAILABLE) when the peer went or never made room."""
        if self._raw is None:
            fd = self._writer.transport.get_extra_info("socket").fileno()
            self._raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(fd))
        view = memoryview(_frame(_MESSAGE, message.SerializeToString()))
        deadline = None
        try:
            while view:
                try:
                    view = view[self._raw.send(view) :]
                except BlockingIOError:
                    deadline = deadline or time.monotonic() + timeout_s
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([], [self._raw], [], left)[1]:
                        raise LocalStreamError(
                            grpc.StatusCode.UNAVAILABLE, f"the local stream's peer took nothing for {timeout_s:.0f} s"
                        ) from None
        except OSError as exc:
            raise LocalStreamError(grpc.StatusCode.UNAVAILABLE, f"{PEER_GONE} ({exc})") from None

    async def done_writing(self) -> None:
        if not self._ended.done():
            self._writer.write(_frame(_END, _END_BODY.pack(0)))

    def cancel(self) -> bool:
        if self._ended.done():
            return False
        self._finish(LocalStreamError(grpc.StatusCode.CANCELLED, "cancelled by this side"))
        return True

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> None:
        await asyncio.shield(self._ended)
        if self._ended.exception() is not None:
            raise self._ended.exception()

    def __aiter__(self):
        return self._responses()

    async def _responses(self):
        while not self._ended.done():
            try:
                kind, body = await _read_frame(self._reader, self._limit)
            except LocalStreamError as exc:
                self._finish(exc)
                break
            if kind == _END:
                self._finish(self._end_of(body))
                break
            yield _decode(self._response_type, body)
        await self._wait()

    async def _await_end(self) -> None:
        try:
            while True:
                kind, body = await _read_frame(self._reader, self._limit)
                if kind == _END:
                    self._finish(self._end_of(body))
                    return
        except LocalStreamError as exc:
            self._finish(exc)

    @staticmethod
    def _end_of(body: bytes) -> LocalStreamError | None:
        code = _status(body[0]) if body else grpc.StatusCode.UNKNOWN
        if code == grpc.StatusCode.OK:
            return None
        details, *pairs = body[1:].decode(errors="replace").split("\0")
        return LocalStreamError(code, details, tuple(tuple(p.split("=", 1)) for p in pairs if "=" in p))

    def _finish(self, error: LocalStreamError | None) -> None:
        if self._ended.done():
            return
        if error is None:
            self._ended.set_result(None)
        else:
            self._ended.set_exception(error)
            self._ended.exception()  # (retrieved: no "never retrieved" warning when nobody awaits)
        self._writer.close()
        if self._raw is not None:  # (a thread may be in `send_now`: it fails; the handle closes with the call)
            with contextlib.suppress(OSError):
                self._raw.shutdown(socket.SHUT_RDWR)
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()

    def _error(self) -> LocalStreamError:
        exc = self._ended.exception()
        return exc or LocalStreamError(grpc.StatusCode.UNAVAILABLE, "the local stream ended")


class LocalUnary:
    """One method's unary calls on a local stream (the KV service's Step): each request
    written gets the one response the peer writes back, in order; the caller makes one call
    at a time. An error ends the stream (the peer's status, as the gRPC call's), and so does a
    call that timed out or was cancelled (its answer could still come): the next call opens
    a new one. Made on an opened stream by `open_stream`, a coroutine giving a LocalCall."""

    def __init__(self, open_stream: Callable[[], Awaitable[LocalCall]]) -> None:
        self._open_stream = open_stream
        self._call: LocalCall | None = None
        self._responses = None
        self.num_streams = 0  # streams opened (1 while no call failed)

    async def connect(self) -> None:
        """Open the stream now if none is (LocalStreamError when the socket does not answer)."""
        if self._call is None:
            self._call = await self._open_stream()
            self._responses = aiter(self._call)
            self.num_streams += 1

    async def __call__(self, request, timeout: float | None = None):
        await self.connect()
        try:
            await self._call.write(request)
            if timeout is None:
                return await anext(self._responses)
            try:
                return await _within(timeout, anext(self._responses))
            except TimeoutError:
                raise LocalStreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {timeout} s") from None
        except StopAsyncIteration:
            self.close()
            raise LocalStreamError(grpc.StatusCode.UNAVAILABLE, "the local stream ended") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = self._responses = None


class DirectWrites:
    """A thread's own writes on a stream (`LocalCall.send_now`) kept in order with the writes
    the event loop still has to make on it: a thread writes itself only while the loop holds
    none (`take`); otherwise its message goes to the loop too, and counts until written
    (`written`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = 0  # messages handed to the event loop, not yet written

    def take(self, call, ready: Callable[[], bool] | None = None) -> bool:
        """Whether the calling thread writes on `call` itself now (a LocalCall the loop has
        nothing of, and `ready()` when given); when not, one more message is the loop's."""
        with self._lock:
            direct = not self._pending and isinstance(call, LocalCall) and call.idle() and (ready is None or ready())
            if not direct:
                self._pending += 1
            return direct

    def written(self) -> None:
        """The event loop wrote (or dropped) one of the messages handed to it."""
        with self._lock:
            self._pending -= 1


async def _within(timeout_s: float, coro):
    """`coro` under a deadline: asyncio.timeout where there is one, not wait_for (Python
    3.11's wait_for can swallow a cancellation that lands as the connection completes, and a
    transport's reconnect then waits forever on a task that never ends); wait_for on 3.10."""
    if _TIMEOUT is None:
        return await asyncio.wait_for(coro, timeout_s)
    async with _TIMEOUT(timeout_s):
        return await coro


async def _dial(address: str, token: bytes, method: str):
    """Connect and say hello: (reader, writer) once the stage took the stream."""
    reader, writer = await asyncio.open_unix_connection("\0" + address[1:], limit=1 << 16)
    try:
        writer.write(_frame(_MESSAGE, token + method.encode()))
        kind, _ = await _read_frame(reader, 4096)
        if kind != _MESSAGE:
            raise LocalStreamError(grpc.StatusCode.UNAUTHENTICATED, f"local socket {address} refused the stream")
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def open_call(
    address: str,
    token: bytes,
    method: str,
    request=None,
    response_type=None,
    max_message_bytes: int = 64 << 20,
    timeout_s: float = 2.0,
) -> LocalCall:
    """A stream of `method` on the socket `address` ("@name"); `request` is written first
    (Events' subscription). LocalStreamError (UNAVAILABLE) when the socket does not answer,
    (UNAUTHENTICATED) when it refuses the token."""
    if not address.startswith("@") or len(token) != _TOKEN_BYTES:
        raise LocalStreamError(grpc.StatusCode.UNAVAILABLE, f"no local socket at {address!r}")
    try:
        reader, writer = await _within(timeout_s, _dial(address, token, method))
    except (OSError, TimeoutError) as exc:
        raise LocalStreamError(grpc.StatusCode.UNAVAILABLE, f"local socket {address}: {exc!r}") from None
    call = LocalCall(reader, writer, response_type, max_message_bytes)
    if request is not None:
        await call.write(request)
    return call


def endpoint(listener: LocalListener | None) -> common_pb2.LocalEndpointReply:
    """A service's `LocalEndpoint` answer: its listener's name and token, or empty when it
    has none (set to gRPC only)."""
    if listener is None:
        return common_pb2.LocalEndpointReply()
    return common_pb2.LocalEndpointReply(local_socket=listener.address, local_token=listener.token)


async def try_open(stub, method: str, request=None, response_type=None, max_message_bytes: int = 64 << 20):
    """A stream of `method` on the local socket of the stage behind `stub` (a StageWorker
    stub), or None where there is none to take: the stage offers none (set to grpc), it is
    on another host, or it does not answer (the caller opens the gRPC stream instead)."""
    try:
        info = await stub.LoadInfo(worker_pb2.LoadInfoRequest(), timeout=2.0)
    except grpc.aio.AioRpcError:
        return None
    label = f"stage {info.stage_index}"
    return await open_offered(
        info.local_socket, info.local_token, method, label, request, response_type, max_message_bytes
    )


async def open_offered(
    address: str,
    token: bytes,
    method: str,
    label: str,
    request=None,
    response_type=None,
    max_message_bytes: int = 64 << 20,
) -> LocalCall | None:
    """A stream of `method` on the socket a peer (`label`, for the log) offered over gRPC, or
    None: it offers none (`address` empty), or the socket does not answer (another host, or
    the peer went): the caller takes gRPC instead."""
    if not address:
        return None
    try:
        return await open_call(address, token, method, request, response_type, max_message_bytes)
    except LocalStreamError as exc:
        log.info("no local %s stream to %s (%s): it goes over gRPC", method, label, exc.details())
        return None
