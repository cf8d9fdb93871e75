"""The `KVCache` servicer on the wire: status codes, table deltas, statistics, health and the
idle integrity check, the gRPC client's outage handling, and the `pagoda kvcache` command."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache_svc.config import KVCacheConfig
from kvcache_svc.core import Append, NewSequence, StepInput
from kvcache_svc.server import SERVICE_NAME, KVCacheService, create_server
from services.grpc_utils import aio_channel
from services.kv_client import GrpcKVCacheClient, KVServiceUnavailable
from services.kv_codec import SEQ_ID_METADATA_KEY
from services.pb import kvcache_pb2, kvcache_pb2_grpc

Body = Callable[[kvcache_pb2_grpc.KVCacheStub, KVCacheService, str], Coroutine[Any, Any, None]]


def serve_and_run(body: Body, **config: Any) -> None:
    async def go() -> None:
        cfg = KVCacheConfig(**{"num_blocks": 16, "block_size": 4, "watermark": 0.0, **config})
        server, port, service = create_server(cfg)
        await server.start()
        await service.start()
        address = f"127.0.0.1:{port}"
        channel = aio_channel(address)
        try:
            await body(kvcache_pb2_grpc.KVCacheStub(channel), service, address)
        finally:
            await channel.close()
            await service.stop()
            await server.stop(grace=None)

    asyncio.run(go())


async def health_status(address: str) -> int:
    async with aio_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        return reply.status


async def code_of(call: Coroutine[Any, Any, Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc_info:
        await call
    return exc_info.value.code(), exc_info.value.details()


def new_pb(seq_id: int, n: int, **fields: Any) -> kvcache_pb2.NewSequence:
    return kvcache_pb2.NewSequence(seq_id=seq_id, token_ids=range(n), **fields)


def test_status_codes_and_what_the_wire_does_not_support():
    async def body(stub, service, address) -> None:
        assert await health_status(address) == health_pb2.HealthCheckResponse.SERVING
        await stub.Step(kvcache_pb2.StepRequest(new_sequences=[new_pb(1, 5)], micro_batch_id=0))
        before = await stub.Stats(kvcache_pb2.KVStatsRequest(include_sequences=True))

        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await stub.Free(kvcache_pb2.FreeRequest(seq_ids=[1, 9]))
        assert exc_info.value.code() == grpc.StatusCode.NOT_FOUND
        assert (SEQ_ID_METADATA_KEY, "9") in tuple(exc_info.value.trailing_metadata())

        bad_requests = [
            kvcache_pb2.StepRequest(
                appends=[kvcache_pb2.AppendSlots(seq_id=1, token_ids=[1], num_new_tokens=4)], micro_batch_id=1
            ),
            kvcache_pb2.StepRequest(new_sequences=[new_pb(2, 3)], micro_batch_id=1, watermark_blocks=3),
            kvcache_pb2.StepRequest(new_sequences=[new_pb(2, 3)]),  # no micro_batch_id
            kvcache_pb2.StepRequest(new_sequences=[new_pb(2, 3, max_num_new_tokens=0)], micro_batch_id=1),
            kvcache_pb2.StepRequest(forks=[kvcache_pb2.SequenceFork(parent_seq_id=1, child_seq_ids=[2, 2])]),
        ]
        for request in bad_requests:
            code, details = await code_of(stub.Step(request))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (request, details)
        code, _ = await code_of(stub.Reset(kvcache_pb2.ResetRequest(keep_prefix_cache=True)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        code, _ = await code_of(
            stub.SubscribeEvents(kvcache_pb2.SubscribeEventsRequest(after_sequence_number=10**6)).read()
        )
        assert code == grpc.StatusCode.OUT_OF_RANGE  # ahead of the last event (tests/service/test_kv_events.py)
        after = await stub.Stats(kvcache_pb2.KVStatsRequest(include_sequences=True))
        assert after == before and after.num_steps == 1

        # unset and empty are different namespaces; an unset chunk size means all tokens
        reply = await stub.Step(
            kvcache_pb2.StepRequest(
                new_sequences=[new_pb(2, 5, namespace=""), new_pb(3, 5, max_num_new_tokens=2)],
                completed_micro_batch_ids=[0],
                micro_batch_id=0,
                watermark_blocks=0,
            )
        )
        assert [a.num_computed_tokens for a in reply.allocations] == [0, 4]
        assert [a.num_new_tokens for a in reply.allocations] == [5, 1]

    serve_and_run(body)


def test_block_tables_travel_as_deltas_and_capacity_comes_along():
    async def body(stub, service, address) -> None:
        reply = await stub.Step(kvcache_pb2.StepRequest(new_sequences=[new_pb(1, 10)], micro_batch_id=1))
        (alloc,) = reply.allocations
        assert (alloc.block_table_offset, list(alloc.block_ids)) == (0, [0, 1, 2])
        assert reply.capacity == kvcache_pb2.KVCapacity(num_total_blocks=16, num_free_blocks=13)
        await stub.Fork(kvcache_pb2.ForkRequest(forks=[kvcache_pb2.SequenceFork(parent_seq_id=1, child_seq_ids=[2])]))
        # decode into the partial block: nothing new to send; then into a new block: one id
        reply = await stub.Step(
            kvcache_pb2.StepRequest(
                appends=[kvcache_pb2.AppendSlots(seq_id=1, token_ids=[7], num_new_tokens=1)], micro_batch_id=2
            )
        )
        (alloc,) = reply.allocations
        assert (alloc.block_table_offset, list(alloc.block_ids)) == (2, [3])
        assert [(c.src_block_id, c.dst_block_id) for c in reply.block_copies] == [(2, 3)]
        reply = await stub.Step(
            kvcache_pb2.StepRequest(appends=[kvcache_pb2.AppendSlots(seq_id=1, token_ids=[8])], micro_batch_id=3)
        )
        (alloc,) = reply.allocations
        assert (alloc.block_table_offset, list(alloc.block_ids)) == (3, [])
        assert alloc.num_new_tokens == 1 and alloc.num_computed_tokens == 11
        reply = await stub.Step(
            kvcache_pb2.StepRequest(appends=[kvcache_pb2.AppendSlots(seq_id=1, token_ids=[9, 10])], micro_batch_id=4)
        )
        (alloc,) = reply.allocations
        assert (alloc.block_table_offset, list(alloc.block_ids)) == (3, [4])
        assert alloc.num_new_tokens == 2 and alloc.num_computed_tokens == 12

        stats = await stub.Stats(kvcache_pb2.KVStatsRequest(include_sequences=True))
        assert [list(s.block_ids) for s in stats.sequences] == [[0, 1, 3, 4], [0, 1, 2]]
        assert (stats.num_free_blocks, stats.num_used_blocks, stats.num_steps) == (11, 5, 4)
        assert stats.num_peak_used_blocks == 5 and stats.enable_prefix_caching
        assert stats.epoch == service.epoch != 0
        freed = await stub.Free(kvcache_pb2.FreeRequest(seq_ids=[1, 2]))
        assert freed.num_released_blocks == 5 and freed.capacity.num_free_blocks == 16
        stats = await stub.Stats(kvcache_pb2.KVStatsRequest(reset_peak=True))
        assert stats.num_peak_used_blocks == 5
        stats = await stub.Stats(kvcache_pb2.KVStatsRequest())
        assert stats.num_peak_used_blocks == 0 and not stats.sequences
        capacity = await stub.CheckCapacity(kvcache_pb2.CheckCapacityRequest(num_blocks=10, watermark_blocks=7))
        assert not capacity.can_allocate
        capacity = await stub.CheckCapacity(kvcache_pb2.CheckCapacityRequest(num_blocks=16))
        assert capacity.can_allocate

    serve_and_run(body)


def test_a_failed_integrity_check_stops_mutations_until_a_reset():
    async def body(stub, service, address) -> None:
        client = GrpcKVCacheClient(address)
        await client.step(StepInput(new_sequences=[NewSequence(1, range(5))], micro_batch_id=1))
        await asyncio.sleep(0.3)
        assert service.num_integrity_checks >= 1 and service.broken is None
        # a bug corrupts the bookkeeping behind the service's back
        service.manager._pool._ref_counts[0] += 1
        await client.step(StepInput(appends=[Append(1, [5])], micro_batch_id=2))
        await asyncio.sleep(0.3)  # idle: the check runs and fails
        assert service.broken is not None and "ref count" in service.broken
        assert await health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(KVServiceUnavailable, match="Reset"):
            await client.step(StepInput(appends=[Append(1, [6])], micro_batch_id=3))
        with pytest.raises(KVServiceUnavailable, match="reset"):  # the client's own guard
            await client.free([1])
        assert (await client.stats()).num_sequences == 1  # reads still work
        assert await client.reset() == 1
        assert service.broken is None
        assert await health_status(address) == health_pb2.HealthCheckResponse.SERVING
        out = await client.step(StepInput(new_sequences=[NewSequence(1, [1])], micro_batch_id=1))
        assert out.results[1].block_ids == (0,)
        await client.close()

    serve_and_run(body, integrity_check_idle_s=0.1)


def test_the_grpc_client_turns_an_outage_into_unavailable_and_wants_a_reset():
    async def go() -> None:
        config = KVCacheConfig(num_blocks=16, block_size=4)
        server, port, service = create_server(config)
        await server.start()
        await service.start()
        client = GrpcKVCacheClient(f"127.0.0.1:{port}", timeout_s=2.0)
        await client.step(StepInput(new_sequences=[NewSequence(1, range(5))], micro_batch_id=1))
        await service.stop()
        await server.stop(grace=None)
        with pytest.raises(KVServiceUnavailable):
            await client.step(StepInput(appends=[Append(1, [5])], micro_batch_id=2))
        with pytest.raises(KVServiceUnavailable):
            await client.stats()
        # a service back on the same address: a new epoch, and the client still wants a reset
        config = KVCacheConfig(num_blocks=16, block_size=4, port=port)
        server, _, service2 = create_server(config)
        await server.start()
        await service2.start()
        try:
            await client.wait_ready()
            assert await client.epoch() == service2.epoch != service.epoch
            with pytest.raises(KVServiceUnavailable, match="reset"):
                await client.step(StepInput(appends=[Append(1, [5])], micro_batch_id=2))
            assert await client.reset() == 0
            out = await client.step(StepInput(new_sequences=[NewSequence(1, range(5))], micro_batch_id=1))
            assert out.results[1].block_ids == (0, 1)
        finally:
            await client.close()
            await service2.stop()
            await server.stop(grace=None)

    asyncio.run(go())


def test_the_server_module_does_not_import_torch():
    code = (
        "import sys, kvcache_svc.server, kvcache_svc.client, services.kv_client, services.kv_codec; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"


def test_kvcache_command_rejects_bad_flags():
    done = subprocess.run(
        [sys.executable, "-m", "wiring.cli", "kvcache", "--num-blocks", "8", "--watermark", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "watermark" in done.stderr


def test_config_derives_address_and_message_limit():
    config = KVCacheConfig(num_blocks=100_000, block_size=16, host="0.0.0.0", port=50060)
    assert config.address == "0.0.0.0:50060"
    assert config.max_message_bytes >= 24 * 1_600_000
    with pytest.raises(ValueError, match="block_size"):
        KVCacheConfig(num_blocks=8, block_size=0)
