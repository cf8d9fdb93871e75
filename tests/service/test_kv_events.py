"""KV events on the wire (issue 13): a subscriber rebuilds the KV service's prefix cache from
`SubscribeEvents` alone, through a randomized run with evictions and shared prefixes,
reconnecting in the middle (resuming from its last sequence number), and once after the
events it missed were no longer kept (told OUT_OF_RANGE, it resynchronises from
`EventsSnapshot`). At the end its index equals the service's cache, key for key, with each
block's parent and tokens; the sequence numbers it saw have no gaps except the one the
snapshot covered."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kvcache_svc.config import KVCacheConfig
from kvcache_svc.server import create_server
from services.grpc_utils import aio_channel
from services.pb import kvcache_pb2, kvcache_pb2_grpc
from services.prefix_hash import ROOT_KEY, block_keys

BLOCK = 4


class Subscriber:
    """What a router's indexer does: follow the events, and resynchronise when told to."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.index: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}  # key -> (parent, tokens)
        self.tier: dict[bytes, str] = {}  # the KV tier's blocks: key -> medium
        self.last = 0
        self.epoch = 0
        self.seen: list[int] = []
        self.snapshots = 0

    async def snapshot(self) -> None:
        snap = await self.stub.EventsSnapshot(kvcache_pb2.EventsSnapshotRequest())
        self.index, self.tier = {}, {}
        for chain in snap.blocks:
            self._store(chain)
        self.last, self.epoch = snap.sequence_number, snap.epoch
        self.snapshots += 1

    def _store(self, chain) -> None:
        if chain.medium:  # the KV tier below the pool: keys only
            for key in chain.block_keys:
                assert key not in self.tier, "stored in the tier twice"
                self.tier[key] = chain.medium
            return
        parent = chain.parent_block_key or ROOT_KEY
        tokens = list(chain.token_ids)
        for i, key in enumerate(chain.block_keys):
            self.index[key] = (parent, tuple(tokens[i * chain.block_size : (i + 1) * chain.block_size]))
            parent = key

    async def follow(self, until: asyncio.Event) -> None:
        """Read events until `until` is set and the stream is drained of what was flushed."""
        call = self.stub.SubscribeEvents(
            kvcache_pb2.SubscribeEventsRequest(after_sequence_number=self.last, epoch=self.epoch)
        )
        try:
            while True:
                try:
                    event = await asyncio.wait_for(call.read(), 0.2)
                except TimeoutError:
                    if until.is_set():
                        return
                    continue
                if event is grpc.aio.EOF:
                    return
                assert event.epoch == self.epoch or self.epoch == 0
                self.epoch = event.epoch
                assert event.sequence_number == self.last + 1, (event.sequence_number, self.last)
                self.last = event.sequence_number
                self.seen.append(event.sequence_number)
                kind = event.WhichOneof("event")
                if kind == "blocks_stored":
                    self._store(event.blocks_stored)
                elif kind == "blocks_removed" and event.blocks_removed.medium:
                    for key in event.blocks_removed.block_keys:
                        assert self.tier.pop(key) == event.blocks_removed.medium
                elif kind == "blocks_removed":
                    for key in event.blocks_removed.block_keys:
                        self.index.pop(key)  # (KeyError: a removal of a block never stored)
                else:
                    self.index.clear()
                    self.tier.clear()
        finally:
            call.cancel()


def cache_of(service) -> dict[bytes, tuple[bytes, tuple[int, ...]]]:
    """The service's prefix cache, read from its manager."""
    from services.prefix_hash import unpack_token_ids

    cache = service.manager._cache  # the test looks inside: the ground truth
    return {e.key: (e.parent_key, unpack_token_ids(e.token_bytes)) for e in cache._entry_by_block.values()}


async def drive(stub, rng: random.Random, steps: int, state: dict) -> None:
    """Random sequences over a few shared prefixes: new ones, their completion, frees."""
    prefixes = [[rng.randrange(1, 50) for _ in range(BLOCK * rng.randint(1, 3))] for _ in range(4)]
    live: list[int] = state.setdefault("live", [])
    for _ in range(steps):
        mb = state["mb"] = state.get("mb", 0) + 1
        req = kvcache_pb2.StepRequest(micro_batch_id=mb, completed_micro_batch_ids=[mb - 1] if mb > 1 else [])
        if live and (rng.random() < 0.45 or len(live) > 4):
            req.free_seq_ids.append(live.pop(rng.randrange(len(live))))
        seq_id = state["seq"] = state.get("seq", 0) + 1
        tokens = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randint(0, 9))]
        req.new_sequences.append(kvcache_pb2.NewSequence(seq_id=seq_id, token_ids=tokens))
        try:
            await stub.Step(req)
            live.append(seq_id)
        except grpc.aio.AioRpcError as exc:  # out of blocks: free everything and go on
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            await stub.Step(
                kvcache_pb2.StepRequest(micro_batch_id=mb, completed_micro_batch_ids=[mb - 1], free_seq_ids=live)
            )
            live.clear()
    mb = state["mb"] = state["mb"] + 1
    await stub.Step(kvcache_pb2.StepRequest(micro_batch_id=mb, completed_micro_batch_ids=[mb - 1]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_subscriber_rebuilds_the_prefix_cache_through_a_reconnect(seed):
    async def go() -> None:
        config = KVCacheConfig(num_blocks=24, block_size=BLOCK, watermark=0.0)
        server, port, service = create_server(config)
        await server.start()
        await service.start()
        channel = aio_channel(f"127.0.0.1:{port}")
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        rng, state = random.Random(seed), {}
        try:
            sub = Subscriber(stub)
            await sub.snapshot()  # a subscriber starts from a snapshot (empty here)
            done = asyncio.Event()
            follower = asyncio.create_task(sub.follow(done))
            await asyncio.sleep(0.1)
            await drive(stub, rng, 60, state)
            done.set()
            await follower
            assert sub.index == cache_of(service)
            assert service.manager.stats().num_evictions > 0  # evictions happened, as removals

            # disconnected while the run goes on: it resumes from its last number, no gap
            await drive(stub, rng, 40, state)
            done = asyncio.Event()
            follower = asyncio.create_task(sub.follow(done))
            await asyncio.sleep(0.1)
            await drive(stub, rng, 20, state)
            done.set()
            await follower
            assert sub.index == cache_of(service)
            assert sub.seen == list(range(1, sub.last + 1)) and sub.snapshots == 1

            # the events it missed are gone: OUT_OF_RANGE, then the snapshot
            await drive(stub, rng, 30, state)
            service.events._kept.clear()  # as if the ring had dropped them
            missed = sub.last
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sub.follow(asyncio.Event())
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert "EventsSnapshot" in err.value.details()
            await sub.snapshot()
            assert sub.last > missed and sub.index == cache_of(service)
            done = asyncio.Event()
            follower = asyncio.create_task(sub.follow(done))
            await asyncio.sleep(0.1)
            await drive(stub, rng, 30, state)
            done.set()
            await follower
            assert sub.index == cache_of(service)

            # a Reset clears the cache: AllBlocksCleared
            done = asyncio.Event()
            follower = asyncio.create_task(sub.follow(done))
            await asyncio.sleep(0.1)
            await stub.Reset(kvcache_pb2.ResetRequest())
            await asyncio.sleep(0.1)
            done.set()
            await follower
            assert sub.index == {} == cache_of(service)
        finally:
            await channel.close()
            await service.stop()
            await server.stop(grace=None)

    asyncio.run(go())


def test_the_router_computes_the_keys_the_service_publishes():
    """The gateway's hash chain (services.prefix_hash) is the KV service's: a prompt's keys
    are those the service stored for it."""

    async def go() -> None:
        server, port, service = create_server(KVCacheConfig(num_blocks=16, block_size=BLOCK, watermark=0.0))
        await server.start()
        await service.start()
        async with aio_channel(f"127.0.0.1:{port}") as channel:
            stub = kvcache_pb2_grpc.KVCacheStub(channel)
            tokens = list(range(3, 3 + 3 * BLOCK + 2))
            await stub.Step(
                kvcache_pb2.StepRequest(
                    micro_batch_id=1, new_sequences=[kvcache_pb2.NewSequence(seq_id=1, token_ids=tokens, namespace="m")]
                )
            )
            await stub.Step(kvcache_pb2.StepRequest(micro_batch_id=2, completed_micro_batch_ids=[1]))
            snap = await stub.EventsSnapshot(kvcache_pb2.EventsSnapshotRequest())
        await service.stop()
        await server.stop(grace=None)
        stored = {k for chain in snap.blocks for k in chain.block_keys}
        assert stored == set(block_keys(tokens, BLOCK, "m"))

    asyncio.run(go())


def test_subscribing_from_another_epoch_is_out_of_range():
    async def go() -> None:
        server, port, service = create_server(KVCacheConfig(num_blocks=16, block_size=BLOCK))
        await server.start()
        await service.start()
        async with aio_channel(f"127.0.0.1:{port}") as channel:
            stub = kvcache_pb2_grpc.KVCacheStub(channel)
            call = stub.SubscribeEvents(kvcache_pb2.SubscribeEventsRequest(epoch=service.epoch + 2))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert "epoch" in err.value.details()
        await service.stop()
        await server.stop(grace=None)

    asyncio.run(go())


def test_a_subscriber_follows_the_kv_tier_by_medium():
    """With a KV tier (--kv-offload), blocks evicted from the pool are announced as stored in
    the "host" medium, demoted ones move to "disk", dropped ones leave: a subscriber's view of
    the tier equals the service's, through the events and through a snapshot."""

    async def scenario():
        config = KVCacheConfig(num_blocks=16, block_size=BLOCK, watermark=0.0, kv_offload="host:3b,disk:/unused:4b")
        server, port, service = create_server(config)
        await server.start()
        channel = aio_channel(f"127.0.0.1:{port}")
        try:
            stub = kvcache_pb2_grpc.KVCacheStub(channel)
            sub = Subscriber(stub)
            done = asyncio.Event()
            follower = asyncio.create_task(sub.follow(done))
            await drive(stub, random.Random(4), 80, {})  # (a seed whose run never runs out of blocks)
            done.set()
            await follower
            want = dict(service.manager.tier_keys())
            assert sub.tier == want and {"host", "disk"} <= set(want.values())
            assert sub.index == cache_of(service)
            fresh = Subscriber(stub)
            await fresh.snapshot()
            assert fresh.tier == want and fresh.index == cache_of(service)
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(scenario())


def test_the_tier_is_published_to_redis_and_weighted_by_the_router(tmp_path):
    """The publisher keeps the tier's keys in their own Redis set; the router's index counts a
    prompt's blocks found only there at `TIER_HIT_WEIGHT` (a load, not a recompute)."""
    from support.redis_server import RedisServer

    from gateway.kv_index import KVIndex
    from gateway.routing import TIER_HIT_WEIGHT
    from services.kv_index_schema import replica_keys

    redis = RedisServer(tmp_path)

    async def scenario():
        config = KVCacheConfig(
            num_blocks=16, block_size=BLOCK, watermark=0.0, kv_offload="host:8b", redis_url=redis.url, replica_id="r0"
        )
        server, port, service = create_server(config)
        await server.start()
        await service.start()
        channel = aio_channel(f"127.0.0.1:{port}")
        index = KVIndex(redis.url)
        try:
            stub = kvcache_pb2_grpc.KVCacheStub(channel)
            a = list(range(1, 1 + 3 * BLOCK))  # three full blocks (the last token's is computed)
            await stub.Step(kvcache_pb2.StepRequest(micro_batch_id=1, new_sequences=[{"seq_id": 1, "token_ids": a}]))
            await stub.Step(kvcache_pb2.StepRequest(micro_batch_id=2, completed_micro_batch_ids=[1], free_seq_ids=[1]))
            b = list(range(100, 100 + 16 * BLOCK))  # the whole pool: a's blocks go to the tier
            await stub.Step(
                kvcache_pb2.StepRequest(
                    micro_batch_id=3, completed_micro_batch_ids=[2], new_sequences=[{"seq_id": 2, "token_ids": b}]
                )
            )
            keys = replica_keys("r0")
            for _ in range(50):  # the publisher follows asynchronously
                held = redis.client.smembers(keys.tier)
                if len(held) == 3:
                    break
                await asyncio.sleep(0.1)
            assert held == {k for k, _ in service.manager.tier_keys()} and len(held) == 3
            found = await index.cached_blocks([("r0", None)], a + [7], BLOCK)
            assert found is not None and found[0]["r0"] == 3 * TIER_HIT_WEIGHT
        finally:
            await index.close()
            await channel.close()
            await service.stop()
            await server.stop(None)

    try:
        asyncio.run(scenario())
    finally:
        redis.stop()


def test_the_gateway_exports_the_kv_tier_per_medium():
    """`/metrics` shows the tier's blocks per medium and its traffic when there is one, and
    nothing of it when there is none."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.metrics import EngineView
    from services.pb import scheduler_pb2

    def scrape(**kv) -> str:
        view = EngineView("m")
        view.stats = scheduler_pb2.GetStatsResponse()
        view.stats.kv_cache.num_total_blocks = 8
        for name, v in kv.items():
            setattr(view.stats.kv_cache, name, v)
        registry = CollectorRegistry()
        registry.register(view)
        return generate_latest(registry).decode()

    text = scrape(tier_host_capacity_blocks=4, tier_host_blocks=3, tier_disk_blocks=5, num_tier_hit_tokens=64)
    assert 'pagoda:kv_tier_host_blocks{model_name="m"} 3.0' in text
    assert 'pagoda:kv_tier_disk_blocks{model_name="m"} 5.0' in text
    assert 'pagoda:kv_tier_hits_total{model_name="m"} 64.0' in text
    assert "pagoda:kv_tier" not in scrape()
