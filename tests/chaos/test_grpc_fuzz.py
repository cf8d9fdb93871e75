"""Fuzzing every gRPC method of every service (issue 16): the public API and the internal
ones, which listen on sockets too. Random bytes and random well-formed messages (every field
set to edge values: huge and negative numbers, odd Unicode, long repeats) go to each method
of a live `pagoda serve` stack (PP=2), with the stack's secret for the internal services.

Required: no INTERNAL or UNKNOWN status (those are crashes in disguise), every process alive
and the stack serving afterwards, and the same greedy output for a probe request as before.
Seeded (replayable): `PAGODA_FUZZ_SEED`; the long profile (`make chaos`) sends more.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter

import grpc
import openai
import pytest
from google.protobuf import descriptor as _descriptor
from support.stack import profile, start_serve

from services.grpc_utils import aio_channel
from services.pb import gateway_pb2, kvcache_pb2, scheduler_pb2, worker_pb2

SEED = int(os.environ.get("PAGODA_FUZZ_SEED", "1234"))
PER_METHOD = 16 if profile() == "quick" else 120
CALL_TIMEOUT_S = 1.0  # a stream that waits (Events, a queued Generate) ends DEADLINE_EXCEEDED: fine
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FD = _descriptor.FieldDescriptor
EDGE_INTS = [0, 1, -1, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1, -(2**63), 2**64 - 1, 7, 1000]
EDGE_STRINGS = ["", "a", "\u0000", "\ud7ff\ue000", "x" * 5000, "🦜" * 50, "../../etc/passwd", "%s%n", "{}"]


def random_message(cls, rng: random.Random, depth: int = 0):
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        if field.containing_oneof is not None and msg.WhichOneof(field.containing_oneof.name):
            continue
        count = rng.choice([1, 2, 5, 50]) if field.is_repeated else 1
        for _ in range(count):
            value = _value(field, rng, depth)
            if value is None:
                continue
            try:
                if field.message_type is not None and field.message_type.GetOptions().map_entry:
                    key_field, value_field = field.message_type.fields
                    getattr(msg, field.name)[_value(key_field, rng, depth)] = _value(value_field, rng, depth)
                elif field.is_repeated:
                    if field.message_type is not None:
                        getattr(msg, field.name).add().CopyFrom(value)
                    else:
                        getattr(msg, field.name).append(value)
                elif field.message_type is not None:
                    getattr(msg, field.name).CopyFrom(value)
                else:
                    setattr(msg, field.name, value)
            except (ValueError, TypeError):  # out of the field's range: protobuf refuses it here
                pass
    return msg


def _value(field, rng: random.Random, depth: int):
    t = field.type
    if t == FD.TYPE_MESSAGE:
        if depth > 2:
            return None
        return random_message(_message_class(field.message_type), rng, depth + 1)
    if t in (FD.TYPE_STRING,):
        return rng.choice(EDGE_STRINGS)
    if t == FD.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 16, 4096]))
    if t == FD.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return rng.choice([0.0, -1.0, 1e30, -1e30, float("nan"), float("inf"), 0.5, 2.0])
    if t == FD.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [99])
    return rng.choice(EDGE_INTS)


def _message_class(descriptor):
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


SERVICES = [service for module in (gateway_pb2, scheduler_pb2, kvcache_pb2, worker_pb2)
            for service in module.DESCRIPTOR.services_by_name.values()]


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    s = start_serve(model_factory(arch="llama"), tmp_path_factory.mktemp("chaos-fuzz"),
                    "--pipeline-parallel-size", "2", "--num-kv-blocks", "256", "--num-threads", "1",
                    "--max-model-len", "512", "--served-model-name", "tiny", "--max-restarts", "20")
    yield s
    s.stop()


def probe(stack) -> list[int]:
    c = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=60)
    r = c.completions.create(model="tiny", prompt="The fuzzing probe", max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].token_ids


def address_of(stack, service_name: str) -> list[str]:
    r = stack.ready
    if service_name.endswith("Generation"):
        return [f"127.0.0.1:{stack.grpc_port}"]
    if service_name.endswith("Scheduler"):
        return [r["scheduler"]]
    if service_name.endswith("KVCache"):
        return [r["kvcache"]]
    return list(r["workers"])


async def _call(channel, method, kind: str, payloads: list[bytes]) -> grpc.StatusCode:
    path = f"/{method.containing_service.full_name}/{method.name}"
    ident = (lambda b: b)  # noqa: E731 - bytes go out as they are
    try:
        if kind == "unary_unary":
            await channel.unary_unary(path, ident, ident)(payloads[0], timeout=CALL_TIMEOUT_S)
        elif kind == "unary_stream":
            async for _ in channel.unary_stream(path, ident, ident)(payloads[0], timeout=CALL_TIMEOUT_S):
                pass
        elif kind == "stream_unary":
            await channel.stream_unary(path, ident, ident)(iter(payloads), timeout=CALL_TIMEOUT_S)
        else:
            async for _ in channel.stream_stream(path, ident, ident)(iter(payloads), timeout=CALL_TIMEOUT_S):
                pass
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_every_method_of_every_service_survives_garbage(stack):
    before = probe(stack)
    rng = random.Random(SEED)
    codes: dict[str, Counter] = {}

    async def fuzz():
        for service in SERVICES:
            for address in address_of(stack, service.full_name):
                async with aio_channel(address) as channel:
                    for method in service.methods:
                        kind = ("stream_" if method.client_streaming else "unary_") + (
                            "stream" if method.server_streaming else "unary")
                        request_class = _message_class(method.input_type)
                        seen = codes.setdefault(f"{service.name}.{method.name}", Counter())
                        for i in range(PER_METHOD):
                            if i % 2:
                                payloads = [rng.randbytes(rng.choice([1, 7, 64, 1024])) for _ in range(rng.randint(1, 3))]
                            else:
                                payloads = [random_message(request_class, rng).SerializeToString()
                                            for _ in range(rng.randint(1, 3))]
                            seen[(await _call(channel, method, kind, payloads)).name] += 1

    asyncio.run(fuzz())
    bad = {m: dict(c) for m, c in codes.items() if any(grpc.StatusCode[k] in BAD for k in c)}
    print("\n[fuzz] " + "; ".join(f"{m}: {dict(c)}" for m, c in sorted(codes.items())))
    assert bad == {}, bad
    stack.wait_serving(90)
    for kind in ("gateway", "scheduler", "kvcache"):
        stack.service_pid(kind)  # alive (perhaps restarted)
    assert probe(stack) == before
