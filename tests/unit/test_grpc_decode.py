"""Issue 16, defect 10: a request whose bytes are not a valid message is INVALID_ARGUMENT with
one log line, on every method of every service (all are built by create_aio_server), for
unary and streaming requests; valid requests are untouched."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from services.grpc_utils import aio_channel, create_aio_server, set_serving

GARBAGE = b"\xff\xff\xff\x07garbage"


def test_undecodable_requests_are_invalid_argument_in_one_log_line(caplog):
    async def main():
        server, port, health = create_aio_server("127.0.0.1:0")
        reflection.enable_server_reflection([reflection.SERVICE_NAME], server)
        await server.start()
        await set_serving(health, "x", True)
        codes = {}
        try:
            async with aio_channel(f"127.0.0.1:{port}") as channel:  # with the stack's secret
                check = channel.unary_unary("/grpc.health.v1.Health/Check")
                watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
                info = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
                for name, call in (
                    ("unary", lambda: check(GARBAGE, timeout=10)),
                    ("server stream", lambda: _drain(watch(GARBAGE, timeout=10))),
                    ("client stream", lambda: _drain(info(iter([GARBAGE]), timeout=10))),
                ):
                    try:
                        await call()
                        codes[name] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as exc:
                        codes[name] = exc.code()
                        assert "not a valid message" in exc.details()
                # valid requests pass through untouched
                ok = await channel.unary_unary(
                    "/grpc.health.v1.Health/Check",
                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString,
                )(health_pb2.HealthCheckRequest(service="x"), timeout=10)
                listed = [
                    r
                    async for r in channel.stream_stream(
                        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                    )(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
                ]
        finally:
            await server.stop(None)
        return codes, ok, listed

    with caplog.at_level(logging.INFO):
        codes, ok, listed = asyncio.run(main())
    assert set(codes.values()) == {grpc.StatusCode.INVALID_ARGUMENT}, codes
    assert ok.status == health_pb2.HealthCheckResponse.SERVING
    assert listed[0].list_services_response.service
    refused = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(refused) == 3 and all(r.levelno == logging.WARNING and r.exc_info is None for r in refused)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def _drain(call):
    async for _ in call:
        pass


def test_a_service_is_not_serving_until_it_says_so():
    """grpcio's health servicer starts "" as SERVING; a launcher probing it would take a
    service that is still starting (a scheduler whose stages are not connected) for ready."""

    async def main():
        server, port, health = create_aio_server("127.0.0.1:0")
        await server.start()
        try:
            async with aio_channel(f"127.0.0.1:{port}") as channel:
                check = channel.unary_unary(
                    "/grpc.health.v1.Health/Check",
                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString,
                )
                before = (await check(health_pb2.HealthCheckRequest(service=""), timeout=10)).status
                await set_serving(health, "x", True)
                after = (await check(health_pb2.HealthCheckRequest(service=""), timeout=10)).status
            return before, after
        finally:
            await server.stop(0)

    before, after = asyncio.run(main())
    assert before == health_pb2.HealthCheckResponse.NOT_SERVING
    assert after == health_pb2.HealthCheckResponse.SERVING
