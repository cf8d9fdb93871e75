"""The gRPC contract: generated code is current, messages round-trip, enums and services are sound."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from services.pb import common_pb2, gateway_pb2, kvcache_pb2, scheduler_pb2, worker_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
PB_DIR = REPO_ROOT / "services" / "pb"
MODULES = (common_pb2, gateway_pb2, kvcache_pb2, scheduler_pb2, worker_pb2)


def _load_gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", REPO_ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_protos = _load_gen_protos()


def _all_messages() -> Iterator[Descriptor]:
    def walk(desc: Descriptor) -> Iterator[Descriptor]:
        if desc.GetOptions().map_entry:
            return
        yield desc
        for nested in desc.nested_types:
            yield from walk(nested)

    for module in MODULES:
        for desc in module.DESCRIPTOR.message_types_by_name.values():
            yield from walk(desc)


def _all_enums() -> Iterator[EnumDescriptor]:
    for module in MODULES:
        yield from module.DESCRIPTOR.enum_types_by_name.values()
    for desc in _all_messages():
        yield from desc.enum_types


# ---------------------------------------------------------------------------------------------
# Generated code


def test_generated_code_is_up_to_date() -> None:
    assert gen_protos.check(PB_DIR) == [], "services/pb is stale: run `make protos`"


def test_check_reports_stale_missing_and_extra_files(tmp_path: Path) -> None:
    out = tmp_path / "pb"
    shutil.copytree(PB_DIR, out, ignore=shutil.ignore_patterns("__pycache__"))
    assert gen_protos.check(out) == []
    (out / "common_pb2.py").write_text("# edited\n", encoding="utf-8")
    (out / "worker_pb2_grpc.py").unlink()
    (out / "old_pb2.py").write_text("", encoding="utf-8")
    assert gen_protos.check(out) == ["missing: worker_pb2_grpc.py", "extra: old_pb2.py", "stale: common_pb2.py"]
    assert gen_protos.main(["--check", str(out)]) == 1


def test_generation_is_deterministic_and_flat(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    names = sorted(p.name for p in gen_protos.generate(first))
    gen_protos.generate(second)
    assert names == sorted(
        f"{stem}{suffix}"
        for stem in ("common", "gateway", "kvcache", "scheduler", "worker")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    )
    for name in names:
        text = (first / name).read_text(encoding="utf-8")
        assert text == (second / name).read_text(encoding="utf-8")
        assert "from pagoda.v1 import" not in text


# ---------------------------------------------------------------------------------------------
# Messages


def _sample_scalar(field: FieldDescriptor, salt: int) -> object:
    t = FieldDescriptor
    if field.type == t.TYPE_ENUM:
        values = [v.number for v in field.enum_type.values if v.number != 0]
        return values[salt % len(values)]
    if field.type in (t.TYPE_DOUBLE, t.TYPE_FLOAT):
        return 0.25 + salt  # exact in float32
    if field.type == t.TYPE_BOOL:
        return True
    if field.type == t.TYPE_STRING:
        return f"{field.name}-{salt}"
    if field.type == t.TYPE_BYTES:
        return bytes([salt % 256, 1, 2, 3])
    if field.type in (t.TYPE_INT32, t.TYPE_SINT32, t.TYPE_SFIXED32, t.TYPE_INT64, t.TYPE_SINT64, t.TYPE_SFIXED64):
        return -(salt + 1) if salt % 2 else salt + 7
    return salt + 3  # unsigned


def _fill(message: Message, depth: int = 0) -> Message:
    """Set every field (one member per oneof) to a non-default value, recursing into messages."""
    seen_oneofs: set[str] = set()
    for i, field in enumerate(message.DESCRIPTOR.fields):
        oneof = field.containing_oneof
        if oneof is not None and oneof.name != f"_{field.name}":  # a real oneof, not `optional`
            if oneof.name in seen_oneofs:
                continue
            seen_oneofs.add(oneof.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = (
                field.message_type.fields_by_name["key"],
                field.message_type.fields_by_name["value"],
            )
            getattr(message, field.name)[_sample_scalar(key_field, i)] = _sample_scalar(value_field, i)
        elif field.message_type is not None:
            if depth > 3:
                continue
            if field.is_repeated:
                for _ in range(2):
                    _fill(getattr(message, field.name).add(), depth + 1)
            else:
                _fill(getattr(message, field.name), depth + 1)
                if not message.HasField(field.name):
                    getattr(message, field.name).SetInParent()
        elif field.is_repeated:
            getattr(message, field.name).extend([_sample_scalar(field, i), _sample_scalar(field, i + 1)])
        else:
            setattr(message, field.name, _sample_scalar(field, i))
    return message


@pytest.mark.parametrize("desc", list(_all_messages()), ids=lambda d: d.full_name)
def test_every_message_round_trips(desc: Descriptor) -> None:
    cls = GetMessageClass(desc)
    original = _fill(cls())
    wire = original.SerializeToString(deterministic=True)
    decoded = cls.FromString(wire)
    assert decoded == original
    assert decoded.SerializeToString(deterministic=True) == wire
    if desc.fields:
        assert wire, f"{desc.full_name} filled with values serialised to nothing"


def test_tensor_carries_float32_bytes() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4) / 7  # [num_tokens, hidden_size]
    tensor = common_pb2.Tensor(
        dtype=common_pb2.DTYPE_FLOAT32, shape=list(array.shape), data=array.astype("<f4").tobytes()
    )
    batch = worker_pb2.MicroBatch(micro_batch_id=5, stage_index=1, hidden_states=tensor)
    decoded = worker_pb2.MicroBatch.FromString(batch.SerializeToString())
    got = decoded.hidden_states
    assert got.dtype == common_pb2.DTYPE_FLOAT32
    assert list(got.shape) == [3, 4]
    assert len(got.data) == array.size * 4
    np.testing.assert_array_equal(np.frombuffer(got.data, dtype="<f4").reshape(tuple(got.shape)), array)


def test_optional_fields_keep_presence() -> None:
    params = common_pb2.SamplingParams()
    assert not params.HasField("temperature") and not params.HasField("seed")
    params.temperature = 0.0
    params.seed = 0
    params.logprobs = 0
    decoded = common_pb2.SamplingParams.FromString(params.SerializeToString())
    assert decoded.HasField("temperature") and decoded.temperature == 0.0
    assert decoded.HasField("seed") and decoded.seed == 0
    assert decoded.HasField("logprobs") and decoded.logprobs == 0
    assert not decoded.HasField("top_p")
    seed_max = common_pb2.SamplingParams(seed=2**64 - 1)
    assert common_pb2.SamplingParams.FromString(seed_max.SerializeToString()).seed == 2**64 - 1


def test_ids_cannot_be_negative() -> None:
    with pytest.raises(ValueError):
        worker_pb2.MicroBatch(token_ids=[-1])
    with pytest.raises(ValueError):
        kvcache_pb2.NewSequence(seq_id=-1)


def test_scheduler_stats_embed_the_stage_and_kv_views() -> None:
    stats = scheduler_pb2.GetStatsResponse(
        health=common_pb2.HEALTH_STATUS_SERVING,
        stages=[
            scheduler_pb2.PipelineStageStats(
                stage_index=0,
                load_info=worker_pb2.StageLoadInfo(num_kv_blocks=64, block_size=16, epoch=9),
                stats=worker_pb2.StageStats(busy_ns=3, idle_ns=1),
            )
        ],
        kv_cache=kvcache_pb2.KVCacheStats(num_total_blocks=64, block_size=16, num_free_blocks=64),
    )
    decoded = scheduler_pb2.GetStatsResponse.FromString(stats.SerializeToString())
    assert decoded.kv_cache.num_total_blocks == decoded.stages[0].load_info.num_kv_blocks
    assert decoded.stages[0].stats.busy_ns == 3


# ---------------------------------------------------------------------------------------------
# Enums


@pytest.mark.parametrize("enum", list(_all_enums()), ids=lambda e: e.full_name)
def test_every_enum_starts_with_unspecified(enum: EnumDescriptor) -> None:
    zero = enum.values_by_number[0].name
    assert zero.endswith("_UNSPECIFIED")
    prefix = zero.removesuffix("UNSPECIFIED")
    # Enum values are scoped to the package, so every value carries the enum's prefix.
    assert all(v.name.startswith(prefix) for v in enum.values), enum.full_name


def test_the_six_request_states_and_finish_reasons() -> None:
    states = {v.name for v in common_pb2.RequestState.DESCRIPTOR.values} - {"REQUEST_STATE_UNSPECIFIED"}
    assert states == {
        f"REQUEST_STATE_{s}" for s in ("WAITING", "PREFILLING", "DECODING", "PREEMPTED", "FINISHED", "ABORTED")
    }
    reasons = set(common_pb2.FinishReason.keys())
    assert {"FINISH_REASON_STOP", "FINISH_REASON_LENGTH", "FINISH_REASON_ABORT", "FINISH_REASON_ERROR"} <= reasons
    dtypes = set(common_pb2.DType.keys())
    assert {
        "DTYPE_FLOAT32",
        "DTYPE_FLOAT16",
        "DTYPE_BFLOAT16",
        "DTYPE_FLOAT8_E4M3FN",
        "DTYPE_INT64",
        "DTYPE_INT32",
    } <= dtypes


# ---------------------------------------------------------------------------------------------
# Services

# method name -> (client streams, server streams)
EXPECTED_SERVICES: dict[tuple[ModuleType, str], dict[str, tuple[bool, bool]]] = {
    (gateway_pb2, "Generation"): {
        "Generate": (False, True),
        "Chat": (False, True),
        "ListModels": (False, False),
        "Embed": (False, False),
    },
    (scheduler_pb2, "Scheduler"): {
        "Generate": (False, True),
        "GenerateStream": (True, True),  # the gateway's one stream per scheduler (issue 37)
        "Abort": (False, False),
        "GetStats": (False, False),
        "LocalEndpoint": (False, False),  # its GenerateStream on a local socket (issue 37)
        "LoadLoraAdapter": (False, False),
        "UnloadLoraAdapter": (False, False),
        "ListLoraAdapters": (False, False),
    },
    (kvcache_pb2, "KVCache"): {
        "Step": (False, False),
        "Fork": (False, False),
        "Free": (False, False),
        "Stats": (False, False),
        "Reset": (False, False),
        "CheckCapacity": (False, False),
        "SubscribeEvents": (False, True),
        "EventsSnapshot": (False, False),
        "ImportPrefix": (False, False),  # P/D disaggregation, the decode side (issue 39)
        "LocalEndpoint": (False, False),  # Step on a local socket (issue 37)
    },
    (worker_pb2, "StageWorker"): {
        "Forward": (True, False),
        "Events": (False, True),
        "LoadInfo": (False, False),
        "GetStats": (False, False),
        "Health": (False, False),
        "Feedback": (True, False),
        "Abandon": (False, False),
        "LoadLoraAdapter": (False, False),
        "UnloadLoraAdapter": (False, False),
        "OpenDataPlane": (False, False),  # the data plane's offer at connect (issue 37)
        "ExportBlocks": (False, True),  # P/D disaggregation (issue 39)
        "PullBlocks": (False, False),
    },
}


@pytest.mark.parametrize("key", list(EXPECTED_SERVICES), ids=lambda k: k[1])
def test_services_have_the_methods_the_system_needs(key: tuple[ModuleType, str]) -> None:
    module, name = key
    service = module.DESCRIPTOR.services_by_name[name]
    assert service.full_name == f"pagoda.v1.{name}"
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == EXPECTED_SERVICES[key]


def test_services_generate_stubs_and_servicers() -> None:
    from services.pb import gateway_pb2_grpc, kvcache_pb2_grpc, scheduler_pb2_grpc, worker_pb2_grpc

    for grpc_module, name in (
        (gateway_pb2_grpc, "Generation"),
        (scheduler_pb2_grpc, "Scheduler"),
        (kvcache_pb2_grpc, "KVCache"),
        (worker_pb2_grpc, "StageWorker"),
    ):
        assert hasattr(grpc_module, f"{name}Stub")
        assert hasattr(grpc_module, f"{name}Servicer")
        assert hasattr(grpc_module, f"add_{name}Servicer_to_server")


# ---------------------------------------------------------------------------------------------
# Documentation: every message, field, enum, value, service and method carries a comment.

# FileDescriptorProto / DescriptorProto / EnumDescriptorProto / ServiceDescriptorProto field numbers.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MSG_FIELD, _MSG_NESTED, _MSG_ENUM, _MSG_ONEOF = 2, 3, 4, 8
_ENUM_VALUE, _SERVICE_METHOD = 2, 2


def _enum_elements(
    e: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], scope: str, commented: set[tuple[int, ...]]
) -> Iterator[tuple[str, bool]]:
    yield f"{scope}.{e.name}", path in commented
    for i, v in enumerate(e.value):
        yield f"{scope}.{e.name}.{v.name}", (*path, _ENUM_VALUE, i) in commented


def _message_elements(
    m: descriptor_pb2.DescriptorProto, path: tuple[int, ...], scope: str, commented: set[tuple[int, ...]]
) -> Iterator[tuple[str, bool]]:
    if m.options.map_entry:
        return
    name = f"{scope}.{m.name}"
    yield name, path in commented
    for i, f in enumerate(m.field):
        yield f"{name}.{f.name}", (*path, _MSG_FIELD, i) in commented
    for i, o in enumerate(m.oneof_decl):
        if not o.name.startswith("_"):  # synthetic oneofs of proto3 `optional`
            yield f"{name}.{o.name}", (*path, _MSG_ONEOF, i) in commented
    for i, nested in enumerate(m.nested_type):
        yield from _message_elements(nested, (*path, _MSG_NESTED, i), name, commented)
    for i, e in enumerate(m.enum_type):
        yield from _enum_elements(e, (*path, _MSG_ENUM, i), name, commented)


def _documented_elements(tmp_path: Path) -> Iterator[tuple[str, bool]]:
    """(element name, has a leading comment) for every element of every .proto file."""
    out = tmp_path / "descriptors.pb"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={gen_protos.PROTO_ROOT}",
        f"--descriptor_set_out={out}",
        "--include_source_info",
        *(p.as_posix() for p in gen_protos.proto_files()),
    ]
    assert gen_protos.protoc.main(args) == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    for file in files.file:
        commented = {tuple(loc.path) for loc in file.source_code_info.location if loc.leading_comments.strip()}
        for i, m in enumerate(file.message_type):
            yield from _message_elements(m, (_FILE_MESSAGE, i), file.package, commented)
        for i, e in enumerate(file.enum_type):
            yield from _enum_elements(e, (_FILE_ENUM, i), file.package, commented)
        for i, s in enumerate(file.service):
            yield f"{file.package}.{s.name}", (_FILE_SERVICE, i) in commented
            for j, method in enumerate(s.method):
                method_path = (_FILE_SERVICE, i, _SERVICE_METHOD, j)
                yield f"{file.package}.{s.name}.{method.name}", method_path in commented


def test_every_element_of_the_contract_is_documented(tmp_path: Path) -> None:
    elements = list(_documented_elements(tmp_path))
    assert len(elements) > 100
    undocumented = [name for name, documented in elements if not documented]
    assert undocumented == []
