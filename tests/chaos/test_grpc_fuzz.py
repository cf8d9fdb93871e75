"""Fuzzing every gRPC method of every service (issue 16): the public API and the internal
ones, which listen on sockets too. Hypothesis draws each method's requests from strategies
built from its message descriptor (every field unset or set: integers across and at the
edges of their wire type, NaN and infinities, any Unicode, long lists, nested messages,
unknown enum values), and raw bytes that are no message at all; they go to each method of a
live `pagoda serve` stack (PP=2), with the stack's secret for the internal services.

Required: no INTERNAL or UNKNOWN status (those are crashes in disguise; hypothesis shrinks
a failing request to its smallest form), every process alive and the stack serving
afterwards, and the same greedy output for a probe request as before. Derandomized
(replayable); the long profile (`make chaos`) sends more.
"""

from __future__ import annotations

import functools
from collections import Counter

import grpc
import openai
import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.stack import profile, start_serve

from services.grpc_utils import INTERNAL_TOKEN_HEADER, internal_token
from services.pb import gateway_pb2, kvcache_pb2, scheduler_pb2, worker_pb2

PER_METHOD = 16 if profile() == "quick" else 120
CALL_TIMEOUT_S = 1.0  # a stream that waits (Events, a queued Generate) ends DEADLINE_EXCEEDED: fine
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FD = _descriptor.FieldDescriptor
MAX_DEPTH = 3
EDGE_STRINGS = ["", "\u0000", "\ud7ff\ue000", "x" * 5000, "🦜" * 50, "../../etc/passwd", "%s%n", "{}"]
_INT_RANGES = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [
        v for v in (0, 1, -1, 7, 1000, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1, -(2**63), 2**64 - 1) if lo <= v <= hi
    ]
    return st.sampled_from(edges) | st.integers(lo, hi)


def _scalar(field) -> st.SearchStrategy:
    t = field.type
    if t in _INT_RANGES:
        return _ints(*_INT_RANGES[t])
    if t == FD.TYPE_STRING:
        return st.sampled_from(EDGE_STRINGS) | st.text(max_size=64)
    if t == FD.TYPE_BYTES:
        return st.binary(max_size=4096)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_FLOAT:
        return st.floats(width=32)
    if t == FD.TYPE_DOUBLE:
        return st.floats()
    if t == FD.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [99, -1])
    raise AssertionError(f"no strategy for {field.full_name} (type {t})")


def _field(field, depth: int) -> st.SearchStrategy:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields
        return st.dictionaries(_scalar(key), _one(value, depth), max_size=6)
    one = _one(field, depth)
    if field.is_repeated:
        return st.lists(one, max_size=8) | st.lists(one, min_size=40, max_size=60)
    return one


def _one(field, depth: int) -> st.SearchStrategy:
    if field.type == FD.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    return _scalar(field)


def _build(cls, values: dict):
    msg = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        target = getattr(msg, name) if field.is_repeated or field.message_type is not None else None
        try:
            if isinstance(value, dict):
                for k, v in value.items():
                    if hasattr(target[k], "CopyFrom"):
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
            elif field.is_repeated:
                for v in value:
                    if field.message_type is not None:
                        target.add().CopyFrom(v)
                    else:
                        target.append(v)
            elif field.message_type is not None:
                target.CopyFrom(value)
            else:
                setattr(msg, name, value)  # (a later member of a oneof replaces an earlier one)
        except (ValueError, TypeError):  # out of what protobuf takes here: the field stays as it is
            pass
    return msg


@functools.cache
def messages(descriptor, depth: int = 0) -> st.SearchStrategy:
    """Messages of `descriptor`'s type: each field unset or drawn for its type (nested
    messages to MAX_DEPTH)."""
    if depth > MAX_DEPTH:
        return st.just(_message_class(descriptor)())
    cls = _message_class(descriptor)
    optional = {f.name: st.deferred(lambda f=f: _field(f, depth)) for f in descriptor.fields}
    return st.fixed_dictionaries({}, optional=optional).map(functools.partial(_build, cls))


def _paths(descriptor, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Every field path of a message type (nested messages to depth 3), as descriptor tuples."""
    out = []
    for f in descriptor.fields:
        out.append((*prefix, f))
        if f.type == FD.TYPE_MESSAGE and not f.is_repeated and depth < 3:
            out += _paths(f.message_type, (*prefix, f), depth + 1)
    return out


def _mutated(base, mutations):
    msg = type(base)()
    msg.CopyFrom(base)
    for path, value in mutations:
        target = msg
        for f in path[:-1]:
            target = getattr(target, f.name)
        values = {path[-1].name: value}
        try:
            target.MergeFrom(_build(type(target), values))
        except (ValueError, TypeError):
            pass
    return msg


def near_valid(base) -> st.SearchStrategy:
    """A request that works (`base`) with one or two fields anywhere in it replaced by drawn
    values: what reaches past the first checks into the service's logic."""
    paths = _paths(base.DESCRIPTOR)
    mutation = st.sampled_from(paths).flatmap(lambda path: st.tuples(st.just(path), _field(path[-1], 2)))
    return st.lists(mutation, min_size=1, max_size=2).map(functools.partial(_mutated, base))


def _valid_requests() -> dict[str, object]:
    text = gateway_pb2.TextGenerateRequest(text="fuzz")
    text.options.sampling_params.max_tokens = 4
    chat = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role="user", content="fuzz")])
    chat.options.sampling_params.max_tokens = 4
    generate = scheduler_pb2.GenerateRequest(request_id="fuzz", prompt_token_ids=[1, 2, 3])
    generate.sampling_params.max_tokens = 4
    return {
        "pagoda.v1.Generation.Generate": text,
        "pagoda.v1.Generation.Chat": chat,
        "pagoda.v1.Scheduler.Generate": generate,
    }


VALID = _valid_requests()


def payloads(method) -> st.SearchStrategy[list[bytes]]:
    """What one call sends: 1-3 messages (a client stream's), each a drawn request, a working
    one with fields replaced, or raw bytes that are no valid message."""
    drawn = messages(method.input_type)
    base = VALID.get(method.full_name)
    if base is not None:
        drawn = drawn | near_valid(base) | near_valid(base)
    one = drawn.map(lambda m: m.SerializeToString()) | st.binary(min_size=1, max_size=1024)
    return st.lists(one, min_size=1, max_size=3)


def _message_class(descriptor):
    return message_factory.GetMessageClass(descriptor)


SERVICES = [
    service
    for module in (gateway_pb2, scheduler_pb2, kvcache_pb2, worker_pb2)
    for service in module.DESCRIPTOR.services_by_name.values()
]


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    s = start_serve(
        model_factory(arch="llama"),
        tmp_path_factory.mktemp("chaos-fuzz"),
        "--pipeline-parallel-size",
        "2",
        "--num-kv-blocks",
        "256",
        "--num-threads",
        "1",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--max-restarts",
        "20",
    )
    yield s
    s.stop()


def probe(stack) -> list[int]:
    c = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=60)
    r = c.completions.create(
        model="tiny",
        prompt="The fuzzing probe",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
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


METHODS = [(service.full_name, method) for service in SERVICES for method in service.methods]
SEEN: dict[str, Counter] = {}


def _call(channel, method, payload: list[bytes], metadata) -> grpc.StatusCode:
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = ("stream_" if method.client_streaming else "unary_") + ("stream" if method.server_streaming else "unary")
    call = getattr(channel, kind)(path)  # bytes go out as they are
    try:
        if method.client_streaming:
            outcome = call(iter(payload), timeout=CALL_TIMEOUT_S, metadata=metadata)
        else:
            outcome = call(payload[0], timeout=CALL_TIMEOUT_S, metadata=metadata)
        if method.server_streaming:
            for _ in outcome:
                pass
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


@pytest.fixture(scope="module")
def probe_before(stack):
    return probe(stack)


@pytest.fixture(scope="module")
def channels(stack):
    opened = {}
    yield lambda address: opened.setdefault(address, grpc.insecure_channel(address))
    for channel in opened.values():
        channel.close()


@pytest.mark.parametrize("service_name,method", METHODS, ids=[f"{s.rsplit('.', 1)[-1]}.{m.name}" for s, m in METHODS])
def test_every_method_of_every_service_survives_garbage(stack, probe_before, channels, service_name, method):
    internal = not service_name.endswith("Generation")
    metadata = ((INTERNAL_TOKEN_HEADER, internal_token()),) if internal and internal_token() else None
    seen = SEEN.setdefault(f"{method.containing_service.name}.{method.name}", Counter())

    @settings(
        max_examples=PER_METHOD, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(payload=payloads(method))
    def fuzz(payload):
        for address in address_of(stack, service_name):
            code = _call(channels(address), method, payload, metadata)
            seen[code.name] += 1
            assert code not in BAD, f"{service_name}.{method.name} at {address}: {code.name}"

    fuzz()


def test_the_stack_is_whole_after_the_fuzzing(stack, probe_before):
    print("\n[fuzz] " + "; ".join(f"{m}: {dict(c)}" for m, c in sorted(SEEN.items())))
    assert SEEN, "the fuzzing ran first"
    stack.wait_serving(90)
    for kind in ("gateway", "scheduler", "kvcache"):
        stack.service_pid(kind)  # alive (perhaps restarted)
    assert probe(stack) == probe_before
