"""The gateway process: REST (uvicorn) and the public gRPC API in one asyncio loop.

    REST   config.host:config.port        the FastAPI app of gateway.app
    gRPC   config.host:config.grpc_port   pagoda.v1.Generation, grpc.health.v1, reflection

The gRPC health status follows the chain's: SERVING only while the scheduler reports every
stage and the KV service serving (what `GET /health` says), so a launcher's health probe
waits for the whole stack. On SIGTERM or SIGINT the gateway stops taking requests (health
NOT_SERVING, new requests 503, listeners closed), lets in-flight ones finish within the
grace period, then cancels what is left (which aborts it downstream) and exits. A second
signal stops at once. REST and gRPC share one rate limiter, so a key's budget is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator, Sequence

import grpc
import uvicorn
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection, reflection_pb2

from gateway.app import Gateway, create_app
from gateway.config import GatewayConfig
from gateway.core import TextGenerator
from gateway.grpc_api import add_generation_service
from services.grpc_utils import create_aio_server, serve_until_signalled, set_serving
from services.text import Tokenizer

KEEP_ALIVE_S = 15  # seconds an idle REST connection stays open
# a REST connection's kernel send buffer (Linux doubles it for its bookkeeping): enough for
# any token stream and a fast LAN, small enough that a stalled client holds little
REST_SEND_BUFFER = 256 * 1024
log = logging.getLogger(__name__)
HEALTH_PERIOD_S = 1.0


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: `serve` owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


ALL_INTERFACES = ("0.0.0.0", "::", "")


def rest_socket(host: str, port: int) -> socket.socket:
    """The REST listener, bound and listening. "All interfaces" ("0.0.0.0", "::") is one
    dual-stack socket, IPv6 and IPv4, as gRPC binds the same host (uvicorn alone would bind
    IPv4 only for 0.0.0.0 and IPv6 only for ::), or IPv4 where the machine has no IPv6.

    Each connection's kernel send buffer is capped at REST_SEND_BUFFER (accepted sockets
    inherit it from the listener): what a client that stops reading holds in the kernel
    stays bounded (autotuning would let it grow to tcp_wmem's maximum, 4 MiB by default),
    and the gateway's read-ahead and stall timeout then see the client's real pace."""
    if host in ALL_INTERFACES:
        candidates = [(socket.AF_INET6, ("::", port), True), (socket.AF_INET, ("0.0.0.0", port), False)]
    else:
        candidates = [
            (family, address, False)
            for family, _, _, _, address in socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        ][:1]
    for i, (family, address, dual_stack) in enumerate(candidates):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            if i + 1 < len(candidates):
                continue  # no IPv6 here
            raise
        try:
            if dual_stack:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, REST_SEND_BUFFER)
            sock.bind(address)
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        return sock
    raise OSError(f"cannot bind {host}:{port}")  # (no candidates: getaddrinfo raises first)


def grpc_address(host: str, port: int) -> str:
    """gRPC's spelling of host:port: IPv6 addresses in brackets; all interfaces ("0.0.0.0",
    "::") dual-stack, which is what gRPC binds for either."""
    if host in ALL_INTERFACES:
        return f"[::]:{port}"
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def _track_health(
    generator: TextGenerator, servicer: health.aio.HealthServicer, names: Sequence[str], gateway: Gateway
) -> None:
    serving: bool | None = None
    while True:
        ok, detail = await generator.health()
        ok = ok and not gateway.draining
        if ok != serving:
            serving = ok
            for name in names:
                await set_serving(servicer, name, ok)
            if ok:
                log.info("the chain is serving")
            else:
                log.warning("not serving: %s", detail or "draining")
        await asyncio.sleep(HEALTH_PERIOD_S)


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: list[str], server: grpc.aio.Server) -> None:
    """Server reflection as `grpc.reflection.v1` (what grpcurl and current clients ask first)
    and `v1alpha` (older ones). grpcio-reflection implements v1alpha only; the two versions'
    messages are the same on the wire, so its servicer answers v1 too, registered under the
    v1 name."""
    names = [*service_names, reflection.SERVICE_NAME, REFLECTION_V1]
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                REFLECTION_V1,
                {
                    "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                        servicer.ServerReflectionInfo,
                        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                    )
                },
            ),
        )
    )


async def serve(config: GatewayConfig) -> None:
    """Runs until SIGTERM or SIGINT, then drains. Raises ValueError when the model directory
    holds no usable tokenizer, OSError when a port cannot be bound."""
    from services import telemetry

    telemetry.setup_tracing("gateway")  # before the generator: it checks once whether tracing is on
    tokenizer = Tokenizer(config.tokenizer or config.model)  # (--chat-template: wiring's folder)
    generator = TextGenerator(
        config.scheduler_address,
        tokenizer,
        config.max_model_len,
        stall_timeout_s=config.stream_stall_timeout_s,
        routing=config.routing,
        redis_url=config.redis_url,
        default_seed=config.seed,
        prefill_address=config.prefill_scheduler,
    )
    generator.start()
    app = create_app(config, generator)
    gateway: Gateway = app.state.gateway

    # one size limit for both front doors: a gRPC request may be as large as a REST body
    grpc_server, grpc_port, health_servicer = create_aio_server(
        grpc_address(config.host, config.grpc_port), max_receive_bytes=config.max_body_bytes, internal=False
    )  # the public API: API keys, not the stack's secret
    names = add_generation_service(
        grpc_server, generator, config, gateway.limiter, gateway.metrics, gateway.limits.loras
    )
    enable_reflection([*names, health.SERVICE_NAME], grpc_server)
    await grpc_server.start()

    rest = _rest_server(app, config)
    try:
        sock = rest_socket(config.host, config.port)
    except OSError as exc:
        await grpc_server.stop(0)
        raise OSError(f"cannot listen on {config.host}:{config.port} (REST): {exc.strerror or exc}") from exc
    rest_task = asyncio.create_task(rest.serve(sockets=[sock]), name="uvicorn")

    def stop_now() -> None:  # a second Ctrl-C: stop waiting for in-flight requests
        log.warning("second signal: stopping now")
        rest.force_exit = True
        asyncio.ensure_future(grpc_server.stop(0))

    async def rest_started() -> None:
        while not rest.started and not rest_task.done():
            await asyncio.sleep(0.05)
        if rest.started:
            _log_serving(config, gateway, generator, names, grpc_port)

    health_task = asyncio.create_task(_track_health(generator, health_servicer, ["", *names], gateway))
    try:
        if not await serve_until_signalled(on_second_signal=stop_now, starting=rest_started(), until=rest_task):
            exc = rest_task.exception()
            raise (
                OSError(f"the REST server stopped: {exc!r}")
                if exc
                else OSError(f"the REST server could not start on {config.host}:{config.port}")
            )
        log.info("draining: in-flight requests get %.0fs to finish", config.grace_period_s)
        gateway.draining = True
        for name in ["", *names]:
            await set_serving(health_servicer, name, False)
        rest.should_exit = True  # uvicorn closes its listeners and waits for its requests
        await asyncio.gather(rest_task, grpc_server.stop(config.grace_period_s), return_exceptions=True)
    finally:
        for task in (health_task, rest_task):
            task.cancel()
        await asyncio.gather(health_task, rest_task, return_exceptions=True)
        await grpc_server.stop(0)
        await generator.close()
        if gateway.limiter is not None:
            await gateway.limiter.close()
        log.info("gateway stopped")


def _rest_server(app, config: GatewayConfig) -> _Uvicorn:
    return _Uvicorn(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            lifespan="off",
            log_config=None,
            timeout_graceful_shutdown=max(1, round(config.grace_period_s)),
            # longer than clients keep an idle connection (httpx, under the openai SDK: 5 s), so
            # a client never reuses one the server is closing at that moment (CI saw "Server
            # disconnected without sending a response" with both at 5 s)
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )


def _log_serving(
    config: GatewayConfig, gateway: Gateway, generator: TextGenerator, names: Sequence[str], grpc_port: int
) -> None:
    if gateway.limiter is not None:
        log.info(
            "rate limits: default %s, buckets %s",
            config.default_rate_limit,
            "in Redis (shared by replicas)" if config.redis_url else "in this process",
        )
    log.info(
        "gateway serving: REST http://%s:%d (model %r), gRPC %s:%d (%s), scheduler %s%s",
        config.host,
        config.port,
        config.model_name,
        config.host,
        grpc_port,
        ", ".join(names),
        config.scheduler_address,
        f" (routing: {config.routing}{', prefix index in Redis' if config.redis_url else ''})"
        if generator.replicas is not None
        else "",
    )
