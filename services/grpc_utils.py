"""gRPC bootstrap shared by every service: message limits, keepalive, health, servers, channels.

The default 4 MB message cap is too small for activations, so every server and channel
takes explicit send/receive limits; keepalive pings make a dead peer show up within
seconds instead of when the next write fails.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


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


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                   max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),
    ]


def create_aio_server(
    address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_receive_bytes: int | None = None
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A grpc.aio server bound to `address` (port 0 picks one) with the standard health service.

    Returns the server (not started), the bound port, and the health servicer, whose
    overall status ("") starts NOT_SERVING; the caller sets SERVING once ready.
    """
    server = grpc.aio.server(options=server_options(max_message_bytes, max_receive_bytes))
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, port, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, service: str, serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    await health_servicer.set("", status)
    await health_servicer.set(service, status)


def aio_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))


def check_health(address: str, service: str = "", timeout_s: float = 1.0) -> bool:
    """Blocking health probe (for launchers and tests): True when the service reports SERVING."""
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
