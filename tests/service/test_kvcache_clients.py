"""One suite for the KV-cache client interface, run against every implementation.

`in-process` is `InProcessKVCacheClient` over a `KVCacheManager`; `grpc` is
`GrpcKVCacheClient` against a `KVCache` grpc.aio server on port 0 in the test's event loop
(its Step calls on the service's local socket, as on one host), `grpc-only` the same server
set to take Step over gRPC only (`--step-channel grpc`); `process` is `GrpcKVCacheClient` against a real `pagoda kvcache` process started through
the CLI. Every test asserts the same exact values for all three.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from kvcache_svc.client import InProcessKVCacheClient
from kvcache_svc.config import KVCacheConfig
from kvcache_svc.core import (
    Allocated,
    Append,
    BlockCopy,
    Fork,
    InvalidStepError,
    KVCacheManager,
    KVCacheStats,
    NewSequence,
    NoBlocks,
    SequenceNotFound,
    StepInput,
    StepOutput,
    slots,
)
from kvcache_svc.server import create_server
from services.kv_client import GrpcKVCacheClient, KVCacheClient
from wiring.launcher import ServiceProcess, free_port, pagoda_command

BS = 4  # block size of every test: small, so block boundaries are easy to hit
KINDS = ("in-process", "grpc", "grpc-only", "process")


@contextlib.asynccontextmanager
async def open_client(
    kind: str, log_dir: Path, num_blocks: int = 16, watermark: float = 0.0
) -> AsyncIterator[KVCacheClient]:
    if kind == "in-process":
        client: KVCacheClient = InProcessKVCacheClient(KVCacheManager(num_blocks, BS, watermark=watermark))
        yield client
        await client.close()
    elif kind in ("grpc", "grpc-only"):
        channel = "grpc" if kind == "grpc-only" else "auto"
        config = KVCacheConfig(num_blocks=num_blocks, block_size=BS, watermark=watermark, step_channel=channel)
        server, port, service = create_server(config)
        await server.start()
        await service.start()
        client = GrpcKVCacheClient(f"127.0.0.1:{port}")
        try:
            yield client
        finally:
            await client.close()
            await service.stop()
            await server.stop(grace=None)
    else:
        port = free_port()
        proc = ServiceProcess(
            "kvcache",
            pagoda_command(
                "kvcache",
                "--port",
                str(port),
                "--num-blocks",
                str(num_blocks),
                "--block-size",
                str(BS),
                "--watermark",
                str(watermark),
                "--step-channel",  # (whatever the environment says: a run forcing gRPC has grpc-only)
                "auto",
            ),
            health_address=f"127.0.0.1:{port}",
            log_path=log_dir / f"kvcache-{port}.log",
        )
        proc.start()
        try:
            await asyncio.to_thread(proc.wait_healthy, 30.0)
            client = GrpcKVCacheClient(proc.health_address)
            try:
                yield client
            finally:
                await client.close()
        finally:
            proc.stop()


Body = Callable[[KVCacheClient], Coroutine[Any, Any, Any]]


def run(kind: str, tmp_path: Path, body: Body, **config: Any) -> Any:
    async def go() -> Any:
        async with open_client(kind, tmp_path, **config) as client:
            return await body(client)

    return asyncio.run(go())


def new(seq_id: int, token_ids, max_num_new_tokens: int | None = None) -> NewSequence:
    return NewSequence(seq_id, tuple(token_ids), max_num_new_tokens=max_num_new_tokens)


async def state(client: KVCacheClient) -> tuple[object, object, object]:
    message = await client.stats_message(include_sequences=True)
    message.epoch = 0  # each implementation draws its own
    return await client.stats(), await client.sequence_stats(), message


kinds = pytest.mark.parametrize("kind", KINDS)


# ---- allocation ------------------------------------------------------------------------------


@kinds
def test_new_sequence_and_appends_get_exact_blocks_and_slots(kind, tmp_path):
    async def body(c: KVCacheClient) -> None:
        out = await c.step(StepInput(new_sequences=[new(1, range(6))], micro_batch_id=1))
        assert out.results == {1: Allocated(1, (0, 1), 6, 0, ())}
        assert out.copies == ()
        # a second sequence lands best-fit right after the first
        out = await c.step(StepInput(new_sequences=[new(2, range(100, 103))], micro_batch_id=2))
        assert out.results[2] == Allocated(2, (2,), 3, 0, ())
        # decode: the partial block fills up first, then a new block comes from the free extent
        out = await c.step(
            StepInput(appends=[Append(1, [6, 7, 8])], completed_micro_batch_ids=[1, 2], micro_batch_id=3)
        )
        # (the table as a diff against the last answer: (0, 1) kept, block 3 added)
        assert out.results == {1: Allocated(1, (3,), 3, 6, (), block_offset=2)}
        assert out.results[1].applied_to((0, 1)) == (0, 1, 3)
        # a chunked prefill: slots for 5 of 10 tokens, the rest comes as an append
        out = await c.step(StepInput(new_sequences=[new(3, range(200, 210), max_num_new_tokens=5)], micro_batch_id=4))
        assert out.results[3] == Allocated(3, (4, 5), 5, 0, ())
        out = await c.step(StepInput(appends=[Append(3, range(205, 210))], micro_batch_id=5))
        assert out.results[3] == Allocated(3, (6,), 5, 5, (), block_offset=2)
        stats = await c.stats()
        assert (stats.num_used_blocks, stats.num_free_blocks, stats.num_sequences) == (7, 9, 3)
        assert stats.num_used_slots == 9 + 3 + 10
        assert stats.internal_fragmentation == pytest.approx((3 + 1 + 2) / 28)

    run(kind, tmp_path, body)


@kinds
def test_prefix_hit_only_after_the_micro_batch_completes(kind, tmp_path):
    prompt = list(range(10, 19))  # two full blocks and one token

    async def body(c: KVCacheClient) -> None:
        await c.step(StepInput(new_sequences=[new(1, prompt)], micro_batch_id=1))
        # micro-batch 1 is still in flight: its blocks are not findable yet
        out = await c.step(StepInput(new_sequences=[new(2, prompt)], micro_batch_id=2))
        assert out.results[2].num_computed_tokens == 0
        out = await c.step(
            StepInput(new_sequences=[new(3, prompt[:8] + [99, 98])], completed_micro_batch_ids=[1], micro_batch_id=3)
        )
        hit = out.results[3]
        assert hit.num_computed_tokens == 8
        assert hit.block_ids[:2] == (0, 1) and slots(hit.block_ids, 8, 2, BS) == (24, 25)
        stats = await c.stats()
        assert (stats.num_prefix_queries, stats.num_prefix_hits) == (3, 1)
        assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (28, 8)
        assert stats.num_cached_blocks == 2
        # freed, the cached blocks stay findable (evictable) for the next one
        assert await c.free([1, 3]) == 4  # the shared two (now evictable) and both tails
        stats = await c.stats()
        assert (stats.num_evictable_blocks, stats.num_used_blocks) == (2, 3)
        out = await c.step(StepInput(new_sequences=[new(4, prompt)], micro_batch_id=4))
        assert out.results[4].num_computed_tokens == 8
        assert out.results[4].block_ids[:2] == (0, 1)

    run(kind, tmp_path, body)


@kinds
def test_whole_prompt_hit_recomputes_the_last_token_in_a_copy(kind, tmp_path):
    prompt = list(range(30, 38))  # exactly two blocks

    async def body(c: KVCacheClient) -> None:
        await c.step(StepInput(new_sequences=[new(1, prompt)], micro_batch_id=1))
        out = await c.step(StepInput(new_sequences=[new(2, prompt)], completed_micro_batch_ids=[1], micro_batch_id=2))
        assert out.results[2] == Allocated(2, (0, 2), 1, 7, (BlockCopy(1, 2),))
        assert out.copies == (BlockCopy(1, 2),)

    run(kind, tmp_path, body)


@kinds
def test_fork_shares_blocks_and_append_copies_on_write(kind, tmp_path):
    async def body(c: KVCacheClient) -> None:
        await c.step(StepInput(new_sequences=[new(1, range(6))], micro_batch_id=1))
        await c.fork(1, [2, 3])
        seqs = {s.seq_id: s for s in await c.sequence_stats()}
        assert seqs[2].num_shared_blocks == 2 and seqs[2].num_tokens == 6
        assert (await c.stats()).num_used_blocks == 2
        # the first two writers into the shared partial block copy it; the last one owns it
        out = await c.step(StepInput(appends=[Append(2, [7]), Append(3, [8]), Append(1, [9])], micro_batch_id=2))
        assert out.results == {
            2: Allocated(2, (0, 2), 1, 6, (BlockCopy(1, 2),)),
            3: Allocated(3, (0, 3), 1, 6, (BlockCopy(1, 3),)),
            1: Allocated(1, (), 1, 6, (), block_offset=2),  # the last one owns block 1: unchanged
        }
        assert out.copies == (BlockCopy(1, 2), BlockCopy(1, 3))
        # a fork inside a step, its child appended in the same step
        out = await c.step(StepInput(forks=[Fork(1, 4)], appends=[Append(4, [5, 5, 5])], micro_batch_id=3))
        assert out.results == {4: Allocated(4, (0, 4, 5), 3, 7, (BlockCopy(1, 4),))}
        stats = await c.stats()
        assert stats.num_copy_on_write == 3 and stats.num_sequences == 4
        message = await c.stats_message(include_sequences=True)
        assert [list(q.block_ids) for q in message.sequences] == [[0, 1], [0, 2], [0, 3], [0, 4, 5]]
        assert (message.num_steps, message.num_peak_used_blocks) == (3, 6)
        # after the copies every later append is private: no more copies
        out = await c.step(StepInput(appends=[Append(2, [1]), Append(4, [2])], micro_batch_id=4))
        assert out.copies == () and out.results[2] == Allocated(2, (), 1, 7, (), block_offset=2)

    run(kind, tmp_path, body)


@kinds
def test_no_blocks_is_a_per_sequence_result_and_the_others_apply(kind, tmp_path):
    async def body(c: KVCacheClient) -> None:
        await c.step(StepInput(new_sequences=[new(1, range(20))], micro_batch_id=1))
        out = await c.step(
            StepInput(
                appends=[Append(1, [1])], new_sequences=[new(2, range(16)), new(3, range(50, 54))], micro_batch_id=2
            )
        )
        assert out.results == {
            1: Allocated(1, (5,), 1, 20, (), block_offset=5),
            2: NoBlocks(2, 4, 2),
            3: Allocated(3, (6,), 4, 0, ()),
        }
        stats = await c.stats()
        assert (stats.num_sequences, stats.num_used_blocks, stats.num_free_blocks) == (2, 7, 1)
        assert [s.seq_id for s in await c.sequence_stats()] == [1, 3]
        # an append short of blocks is left exactly as it was
        out = await c.step(StepInput(appends=[Append(3, range(9))], micro_batch_id=3))
        assert out.results == {3: NoBlocks(3, 3, 1)}
        assert (await c.stats()) == stats

    run(kind, tmp_path, body, num_blocks=8)


INVALID_STEPS = [
    (StepInput(appends=[Append(9, [1])], micro_batch_id=5), SequenceNotFound),
    (StepInput(frees=[9]), SequenceNotFound),
    (StepInput(forks=[Fork(9, 10)]), SequenceNotFound),
    (StepInput(new_sequences=[new(5, [1]), new(5, [2])], micro_batch_id=5), InvalidStepError),
    (StepInput(new_sequences=[new(1, [1])], micro_batch_id=5), InvalidStepError),
    (StepInput(frees=[1, 1]), InvalidStepError),
    (StepInput(forks=[Fork(1, 2)]), InvalidStepError),
    (StepInput(new_sequences=[new(-1, [1])], micro_batch_id=5), InvalidStepError),
    (StepInput(new_sequences=[new(5, [1, -2])], micro_batch_id=5), InvalidStepError),
    (StepInput(new_sequences=[new(5, [1], max_num_new_tokens=0)], micro_batch_id=5), InvalidStepError),
    (StepInput(new_sequences=[new(5, [1], max_num_new_tokens=-3)], micro_batch_id=5), InvalidStepError),
    (StepInput(appends=[Append(1, [])], micro_batch_id=5), InvalidStepError),
    (StepInput(appends=[Append(1, [1])]), InvalidStepError),  # no micro_batch_id
    (StepInput(completed_micro_batch_ids=[77]), InvalidStepError),
    (StepInput(new_sequences=[new(5, range(65))], micro_batch_id=5), InvalidStepError),
]


@kinds
def test_invalid_steps_raise_and_change_nothing(kind, tmp_path):
    async def body(c: KVCacheClient) -> None:
        await c.step(StepInput(new_sequences=[new(1, range(6))], micro_batch_id=1))
        await c.fork(1, [2])
        before = await state(c)
        for step, error in INVALID_STEPS:
            # each bad step also carries valid work, which must not be applied either
            step = StepInput(
                new_sequences=[*step.new_sequences, new(40, range(8))],
                appends=step.appends,
                forks=step.forks,
                frees=step.frees,
                completed_micro_batch_ids=step.completed_micro_batch_ids,
                micro_batch_id=5 if step.micro_batch_id is None and not step.appends else step.micro_batch_id,
            )
            with pytest.raises(error):
                await c.step(step)
            assert await state(c) == before, step
        with pytest.raises(SequenceNotFound) as exc_info:
            await c.free([2, 9])
        assert exc_info.value.seq_id == 9 and "unknown sequence 9" in str(exc_info.value)
        with pytest.raises(SequenceNotFound):
            await c.fork(9, [10])
        with pytest.raises(InvalidStepError):
            await c.fork(1, [2])
        with pytest.raises(InvalidStepError):
            await c.check_capacity(-1)
        assert await state(c) == before
        # and the state still works
        out = await c.step(StepInput(appends=[Append(1, [6])], micro_batch_id=2))
        assert out.results[1] == Allocated(1, (2,), 1, 6, (BlockCopy(1, 2),), block_offset=1)

    run(kind, tmp_path, body)


# ---- free, reset, capacity -------------------------------------------------------------------


@kinds
def test_free_releases_blocks(kind, tmp_path):
    async def body(c: KVCacheClient) -> None:
        await c.step(StepInput(new_sequences=[new(1, range(6)), new(2, range(9))], micro_batch_id=1))
        await c.fork(2, [3])
        assert await c.free([2]) == 0  # the child still holds its blocks
        assert await c.free([3, 1]) == 5
        assert await c.free([]) == 0
        stats = await c.stats()
        assert (stats.num_used_blocks, stats.num_free_blocks, stats.num_sequences) == (0, 16, 0)
        assert (stats.num_free_extents, stats.largest_free_extent) == (1, 16)
        with pytest.raises(SequenceNotFound):
            await c.free([1])
        # freed ids can be reused
        out = await c.step(StepInput(new_sequences=[new(1, [1])], micro_batch_id=2))
        assert out.results[1] == Allocated(1, (0,), 1, 0, ())

    run(kind, tmp_path, body)


@kinds
def test_reset_drops_everything_and_keeps_counters(kind, tmp_path):
    async def body(c: KVCacheClient) -> None:
        epoch = await c.epoch()
        await c.step(StepInput(new_sequences=[new(1, range(8)), new(2, range(5))], micro_batch_id=1))
        await c.step(StepInput(new_sequences=[new(3, range(8))], completed_micro_batch_ids=[1], micro_batch_id=2))
        assert await c.reset() == 3
        stats = await c.stats()
        assert (stats.num_used_blocks, stats.num_free_blocks, stats.num_cached_blocks) == (0, 16, 0)
        assert (stats.num_sequences, stats.num_resets, stats.num_prefix_queries) == (0, 1, 3)
        assert stats.num_prefix_hit_tokens == 7
        # the micro-batch in flight is gone and so are the ids
        with pytest.raises(InvalidStepError):
            await c.step(StepInput(completed_micro_batch_ids=[2]))
        out = await c.step(StepInput(new_sequences=[new(1, range(8))], micro_batch_id=2))
        assert out.results[1] == Allocated(1, (0, 1), 8, 0, ())
        assert await c.reset() == 1
        assert await c.epoch() == epoch

    run(kind, tmp_path, body)


@kinds
def test_check_capacity_leaves_the_watermark(kind, tmp_path):
    async def body(c: KVCacheClient) -> None:
        assert (await c.stats()).watermark_blocks == 2
        assert await c.check_capacity(18) and not await c.check_capacity(19)
        out = await c.step(StepInput(new_sequences=[new(1, range(64)), new(2, range(4))], micro_batch_id=1))
        # 16 blocks for the first leaves 4; the second may take 1 more, leaving 3 >= 2
        assert out.results[2] == Allocated(2, (16,), 4, 0, ())
        assert await c.check_capacity(1) and not await c.check_capacity(2)
        out = await c.step(StepInput(new_sequences=[new(3, range(8))], micro_batch_id=2))
        assert out.results[3] == NoBlocks(3, 2, 1)
        # appends may use the watermark's blocks
        out = await c.step(StepInput(appends=[Append(1, range(9))], micro_batch_id=3))
        assert out.results[1].block_ids[-3:] == (17, 18, 19)

    run(kind, tmp_path, body, num_blocks=20, watermark=0.1)


# ---- the same calls give the same numbers ------------------------------------------------------


async def scenario(c: KVCacheClient, seed: int, num_rounds: int = 60) -> list[object]:
    """A small scheduler: shared prefixes, chunked prefills, decodes, forks, failures,
    frees, preemption when short of blocks, bad steps. Returns everything observed."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([4, 8, 10]))] for _ in range(3)]
    live: dict[int, list[int]] = {}  # seq_id -> tokens not given slots yet
    next_seq_id, trace = 1, []
    in_flight: list[int] = []
    for mb in range(1, num_rounds + 1):
        completed = [m for m in in_flight if rng.random() < 0.9]
        failed = [m for m in in_flight if m not in completed]
        in_flight = []
        frees = [s for s in live if not live[s] and rng.random() < 0.15]
        for s in frees:
            del live[s]
        forks = []
        if live and rng.random() < 0.3:
            parent = rng.choice([s for s in live if not live[s]] or [None])
            if parent is not None:
                forks.append(Fork(parent, next_seq_id))
                live[next_seq_id] = []
                next_seq_id += 1
        appends = []
        for s, pending in live.items():
            if pending:
                chunk, live[s] = pending[:3], pending[3:]
                appends.append(Append(s, chunk))
            elif rng.random() < 0.7:
                appends.append(Append(s, [rng.randrange(1000)]))
        news = []
        for _ in range(rng.choice([0, 1, 1, 2])):
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(4))]
            chunk = rng.choice([None, None, 3])
            news.append(NewSequence(next_seq_id, prompt, max_num_new_tokens=chunk))
            next_seq_id += 1
        step = StepInput(
            new_sequences=news,
            appends=appends,
            forks=forks,
            frees=frees,
            completed_micro_batch_ids=completed,
            failed_micro_batch_ids=failed,
            micro_batch_id=mb,
        )
        if rng.random() < 0.1:  # a bad step: nothing of it applies
            bad = StepInput(appends=[*appends, Append(10**6, [1])], micro_batch_id=mb)
            with pytest.raises(SequenceNotFound) as exc_info:
                await c.step(bad)
            trace.append(str(exc_info.value))
        out = await c.step(step)
        in_flight.append(mb)
        trace.append(out)
        for new_seq in news:
            result = out.results[new_seq.seq_id]
            if isinstance(result, Allocated):
                live[new_seq.seq_id] = list(new_seq.token_ids[result.num_computed_tokens + result.num_new_tokens :])
        for seq_id, result in out.results.items():
            if isinstance(result, NoBlocks) and seq_id in live:
                del live[seq_id]  # preempted: freed now, readmitted later as a new sequence
                trace.append(await c.free([seq_id]))
        trace.extend(await state(c))
        if mb % 25 == 0:
            trace.append(await c.reset())
            live.clear()
            in_flight.clear()
    return trace


def test_the_same_calls_give_the_same_numbers_on_every_client(tmp_path):
    traces = {kind: run(kind, tmp_path, lambda c: scenario(c, seed=7), num_blocks=24) for kind in KINDS}
    stats = [t for t in traces["in-process"] if isinstance(t, KVCacheStats)]
    # the scenario really exercised what it is meant to
    assert stats[-1].num_prefix_hits > 0 and stats[-1].num_copy_on_write > 0
    assert stats[-1].num_evictions > 0 and stats[-1].num_resets == 2
    assert any(
        isinstance(r, NoBlocks) for t in traces["in-process"] if isinstance(t, StepOutput) for r in t.results.values()
    )
    assert traces["grpc"] == traces["in-process"]
    assert traces["grpc-only"] == traces["in-process"]
    assert traces["process"] == traces["in-process"]


@pytest.mark.parametrize("kind,channel", [("grpc", "unix"), ("grpc-only", "grpc"), ("process", "unix")])
def test_step_takes_the_local_socket_where_the_service_offers_one(tmp_path, kind, channel):
    """On one host Step goes on the KV service's local socket (issue 37), unless the service
    is set to gRPC only; a Step that fails there (a sequence not found) ends that stream and
    the next call opens another; after a reset the client asks for the socket again."""

    async def scenario(c: GrpcKVCacheClient):
        await c.step(StepInput(new_sequences=[NewSequence(1, [1, 2, 3, 4, 5])], micro_batch_id=1))
        went = [c.step_channel]
        with pytest.raises(SequenceNotFound) as missing:
            await c.step(StepInput(appends=[Append(99, [1])], micro_batch_id=2))
        out = await c.step(StepInput(appends=[Append(1, [6])], completed_micro_batch_ids=[1], micro_batch_id=3))
        went.append(c.step_channel)
        await c.reset()
        await c.step(StepInput(new_sequences=[NewSequence(2, [1, 2])], micro_batch_id=4))
        went.append(c.step_channel)
        streams = c._local_step.num_streams if c._local_step is not None else 0
        return went, missing.value.seq_id, out, streams

    went, missing, out, streams = run(kind, tmp_path, scenario)
    assert went == [channel] * 3 and missing == 99
    assert isinstance(out.results[1], Allocated)
    assert streams == (1 if channel == "unix" else 0)  # (a fresh one after the reset)
