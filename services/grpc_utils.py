"""gRPC bootstrap shared by every service: message limits, keepalive, health, servers, channels,
and the end of every server's main (`serve_until_signalled`).

The default 4 MB message cap is too small for activations, so every server and channel
takes explicit send/receive limits; keepalive pings make a dead peer show up within
seconds instead of when the next write fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import io
import logging
import os
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.settings import INTERNAL_TOKEN, env_text

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_PENDING_CALLS = 50_000  # calls a server holds before the application picks them up
# Service-to-service authentication: a shared secret every internal call carries
INTERNAL_TOKEN_ENV = INTERNAL_TOKEN.variable
INTERNAL_TOKEN_HEADER = "x-pagoda-internal-token"
# Why a scheduler's Generate failed UNAVAILABLE, in the call's trailing metadata: the gateway
# decides to retry by this, never by the message's words. PIPELINE_DOWN: the scheduler is up
# but its pipeline stayed down past its recovery timeout (another replica may serve; a lone
# scheduler's answer is final).
_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}


def status_from_value(value: int) -> grpc.StatusCode:
    """A status code carried as its number (google.rpc.Code) in a message; UNKNOWN if none."""
    return _STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


UNAVAILABLE_REASON_KEY = "pagoda-unavailable"
PIPELINE_DOWN = "pipeline"
_OPEN_METHODS = ("/grpc.health.v1.Health/",)  # probes need no secret


def internal_token() -> str | None:
    """The stack's shared secret (`PAGODA_INTERNAL_TOKEN`; `pagoda serve` makes one per run),
    or None: internal services then take any caller (bind them to loopback only)."""
    return env_text(INTERNAL_TOKEN) or None


log = logging.getLogger(__name__)


class _Undecodable:
    """What a request that cannot be parsed decodes to, so that its call can be refused."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    """A request whose bytes are not a valid message of its method's type is refused with
    INVALID_ARGUMENT and one log line (grpc's own handling answers UNKNOWN and logs an ERROR
    traceback for every such call). Applies to every method of the server, streams too."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        kind = _behaviour_kind(handler)
        behaviour = _refusing_undecodable(kind, handler, handler_call_details.method)
        return handler._replace(request_deserializer=_safe_decoder(handler.request_deserializer), **{kind: behaviour})


_BEHAVIOUR_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def _behaviour_kind(handler: grpc.RpcMethodHandler) -> str:
    """Which of a method handler's four behaviours it has."""
    return next(kind for kind in _BEHAVIOUR_KINDS if getattr(handler, kind) is not None)


def _safe_decoder(decode):
    """`decode`, but a request that cannot be parsed decodes to `_Undecodable` instead of raising."""

    def safe_decode(data: bytes):
        try:
            return decode(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and its kin
            return _Undecodable(f"{type(exc).__name__}: {exc}")

    return safe_decode


def _refusing_undecodable(kind: str, handler: grpc.RpcMethodHandler, method: str):
    """The handler's `kind` behaviour, refusing a request that decoded to `_Undecodable`
    (on a stream: when it arrives) before it reaches the servicer."""

    async def refuse(bad: _Undecodable, context) -> None:
        log.warning("%s: refused an undecodable request (%s)", method, bad.reason)
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message for {method}: {bad.reason}"
        )

    async def checked(requests, context):
        async for request in requests:
            if isinstance(request, _Undecodable):
                await drain_requests(requests)  # (see drain_requests)
                await refuse(request, context)
            yield request

    async def unary_unary(request, context):
        if isinstance(request, _Undecodable):
            await refuse(request, context)
        return await handler.unary_unary(request, context)

    async def unary_stream(request, context):
        if isinstance(request, _Undecodable):
            await refuse(request, context)
        async for response in _responses(handler.unary_stream(request, context)):
            yield response

    async def stream_unary(requests, context):
        return await handler.stream_unary(checked(requests, context), context)

    async def stream_stream(requests, context):
        async for response in _responses(handler.stream_stream(checked(requests, context), context)):
            yield response

    wrapped = {
        "unary_unary": unary_unary,
        "unary_stream": unary_stream,
        "stream_unary": stream_unary,
        "stream_stream": stream_stream,
    }
    return wrapped[kind]


class RequireToken(grpc.aio.ServerInterceptor):
    """Internal services refuse a call without the stack's secret (UNAUTHENTICATED, before
    the request is even read), health checks excepted."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_OPEN_METHODS):
            return handler
        sent = dict(handler_call_details.invocation_metadata or ()).get(INTERNAL_TOKEN_HEADER, "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._token):
            return handler

        async def refuse(request_or_requests, context):
            if hasattr(request_or_requests, "__aiter__"):
                await drain_requests(request_or_requests)  # (see drain_requests)
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: an internal service; calls need the stack's token ({INTERNAL_TOKEN_HEADER})",
            )

        async def refuse_stream(request_or_requests, context):
            await refuse(request_or_requests, context)
            yield  # pragma: no cover - never reached: abort raises

        kind = _behaviour_kind(handler)
        return handler._replace(**{kind: refuse_stream if kind.endswith("_stream") else refuse})


class _WithToken:
    """A multicallable whose calls carry the stack's secret, added to each call's metadata.
    (Not a client interceptor: grpc.aio runs intercepted calls through Python tasks and
    iterator wrappers, a cost on every streamed message of the step protocol.)"""

    __slots__ = ("_call", "_pair")

    def __init__(self, call, pair: tuple[str, str]) -> None:
        self._call, self._pair = call, pair

    def __call__(self, request=None, *args, metadata=None, **kwargs):
        metadata = (*metadata, self._pair) if metadata else (self._pair,)
        return self._call(request, *args, metadata=metadata, **kwargs)


class TokenChannel:
    """A grpc.aio channel whose every call carries the stack's secret (stubs take it as a
    channel: they ask it for their multicallables)."""

    def __init__(self, channel: grpc.aio.Channel, token: str) -> None:
        self._channel, self._pair = channel, (INTERNAL_TOKEN_HEADER, token)

    def unary_unary(self, *args, **kwargs):
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._pair)

    def unary_stream(self, *args, **kwargs):
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._pair)

    def stream_unary(self, *args, **kwargs):
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._pair)

    def stream_stream(self, *args, **kwargs):
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._pair)

    def __getattr__(self, name: str):  # close, channel_ready, get_state, ...
        return getattr(self._channel, name)

    async def __aenter__(self) -> TokenChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.close()


async def drain_requests(requests, limit_s: float = 1.0) -> None:
    """Reads what a client still sends on a stream the server is about to refuse (for at most
    `limit_s`): a call that ends while its client is still writing or half-closing is
    reported to that client as INTERNAL ("Internal error from Core") instead of the status
    the server gave."""

    async def consume() -> None:
        async for _ in requests:
            pass

    with contextlib.suppress(Exception):
        await asyncio.wait_for(consume(), limit_s)


async def _responses(result):
    """A streaming behaviour's responses: an async generator's, or none from a coroutine
    that wrote them itself (`context.write`)."""
    if inspect.isasyncgen(result):
        async for response in result:
            yield response
    else:
        await result


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly after a peer restarts (the default backoff reaches minutes).
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def server_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_receive_bytes: int | None = None
) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),
        # gRPC core cancels calls the application has not picked up yet once more than 1,000
        # are pending and one waited 1 s: a burst of 2,000 streams lost ~150 of them as
        # CANCELLED (issue 16, defect 5). Overload is the queue's to refuse (429 /
        # RESOURCE_EXHAUSTED with Retry-After), not the transport's to cancel silently.
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
        ("grpc.server_max_unrequested_time_in_server", 60),
    ]


def create_aio_server(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_receive_bytes: int | None = None,
    internal: bool = True,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A grpc.aio server bound to `address` (port 0 picks one) with the standard health service.

    `internal` (every service but the gateway's public API): calls need the stack's secret
    when one is set (`internal_token`). Returns the server (not started), the bound port, and
    the health servicer, whose overall status ("") starts NOT_SERVING; the caller sets
    SERVING once ready.
    """
    token = internal_token() if internal else None
    interceptors = [RequireToken(token)] if token else []
    if internal and not token and not address.startswith(("127.", "localhost", "[::1]", "::1")):
        log.warning(
            "%s: an internal service bound beyond loopback takes any caller; set %s on every "
            "service of the stack (pagoda serve makes one per run)",
            address,
            INTERNAL_TOKEN_ENV,
        )
    server = grpc.aio.server(
        options=server_options(max_message_bytes, max_receive_bytes), interceptors=[*interceptors, RefuseUndecodable()]
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    health_servicer = _Health()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, port, health_servicer


class _Health(health.aio.HealthServicer):
    """grpcio's health servicer, but NOT_SERVING overall until the service says otherwise
    (`set_serving`). grpcio starts "" as SERVING: a launcher probing it would take a
    scheduler whose pipeline is not connected yet for ready (the gRPC fuzzer's finding:
    requests admitted then before the vocabulary was known)."""

    def __init__(self) -> None:
        super().__init__()
        self._server_status[""] = health_pb2.HealthCheckResponse.NOT_SERVING


async def set_serving(health_servicer: health.aio.HealthServicer, service: str, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set("", status)
    await health_servicer.set(service, status)


def aio_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.aio.Channel | TokenChannel:
    """A channel to an internal service: its calls carry the stack's secret when one is set."""
    token = internal_token()
    channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))
    return TokenChannel(channel, token) if token else channel


def check_health(address: str, service: str = "", timeout_s: float = 1.0) -> bool:
    """Blocking health probe (for launchers and tests): True when the service reports SERVING."""
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def write_ready_file(path: str, port: int) -> None:
    """`port` and a newline into `path`, whole or not at all: written beside it, then renamed
    over it, so a watcher that polls for the file never reads half of it."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(f"{port}\n")
    os.replace(partial, path)


def log_tasks() -> None:
    """SIGUSR1 on any service: every asyncio task's stack to the log, to see what a process
    that answers nothing waits for (`kill -USR1 PID`)."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        task.print_stack(limit=12, file=out)
    log.warning("asyncio tasks (SIGUSR1):\n%s", out.getvalue())


async def serve_until_signalled(
    *,
    port: int | None = None,
    ready_file: str | None = None,
    stop: asyncio.Event | None = None,
    on_second_signal: Callable[[], None] | None = None,
    starting: Awaitable[object] | None = None,
    until: asyncio.Future | None = None,
) -> bool:
    """The end of every server's main, called once its server is started; the graceful stop
    that follows is the caller's. In order:

    - SIGTERM and SIGINT set `stop` (the caller's event, which it may also set itself, e.g.
      on a fatal error; a new one when None). A signal that finds `stop` already set calls
      `on_second_signal` when given (a second Ctrl-C: stop at once instead of draining).
    - `starting` is awaited: what the server still waits for before it is ready.
    - the bound `port` is written to `ready_file` when one is given (`write_ready_file`).
    - it waits for `stop`, or for `until` to end (a task the serving depends on).

    Returns True once stopped, False when `until` ended first (the serving failed)."""
    if ready_file and port is None:
        raise ValueError("serve_until_signalled: a ready_file needs the port to write into it")
    stop = stop if stop is not None else asyncio.Event()

    def on_signal() -> None:
        if stop.is_set() and on_second_signal is not None:
            on_second_signal()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in SHUTDOWN_SIGNALS:
        loop.add_signal_handler(sig, on_signal)
    loop.add_signal_handler(signal.SIGUSR1, log_tasks)
    if starting is not None:
        await starting
    if ready_file:
        write_ready_file(ready_file, port)
    if until is None:
        await stop.wait()
        return True
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({stopped, until}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    return stop.is_set()
