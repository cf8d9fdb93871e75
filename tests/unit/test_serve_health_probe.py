"""`pagoda serve` says "ready" only once its gateway answers: the probe asks for the
gateway's own service's health, so another server on that port saying SERVING (a session 22
CI run: the KV service had been handed the gateway's port) is not taken for it."""

from __future__ import annotations

import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from wiring.launcher import ServiceProcess


@pytest.fixture
def other_server():
    """A gRPC server whose overall health ("") is SERVING, and no Generation service."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_a_named_probe_does_not_take_another_server_for_the_gateway(other_server):
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    anyone = ServiceProcess("gateway", sleeper, other_server)
    named = ServiceProcess("gateway", sleeper, other_server, health_service="pagoda.v1.Generation")
    try:
        anyone.start()
        anyone.wait_healthy(5)  # the server's overall health: any server there says SERVING
        named.start()
        with pytest.raises(TimeoutError, match="not healthy"):
            named.wait_healthy(1)
    finally:
        anyone.kill()
        named.kill()
