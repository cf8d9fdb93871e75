"""Stage workers as real processes chained over gRPC on loopback, driven by a test driver.

Hidden states cross between stages on the channel the stages choose (issue 37): a
shared-memory ring on this host; again with the gRPC fallback forced (`--stage-channel
grpc`); and on the point-to-point link of the NCCL channel, which CPU stages run on gloo:
the same output every way."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
import torch
from support.driver import DriverSeq, PlanBuilder
from support.grpc_driver import GrpcPipelineDriver, StageFailure
from support.reference import HFReference
from support.workers import start_chain

from services.pb import worker_pb2
from services.sampling import SamplingParams
from services.step import CachedSeq, NewSeq, StepPlan
from services.step_codec import plan_to_pb, result_from_pb

PROMPT_LENGTHS = (1, 3, 16, 17, 45, 100, 177, 300)
NEW_TOKENS = 24
BLOCK_SIZE = 16
NUM_BLOCKS = 256
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


class _Chain(list):
    """The chain's processes, and the channel its hand-offs take."""

    channel = ""


@pytest.fixture(
    scope="module",
    params=[(2, "auto"), (3, "auto"), (2, "grpc"), (3, "grpc"), (3, "nccl")],
    ids=["2-stages", "3-stages", "2-stages-grpc", "3-stages-grpc", "3-stages-p2p"],
)
def chain(request, model_dir, tmp_path_factory):
    num_stages, channel = request.param
    procs = _Chain(
        start_chain(
            model_dir,
            num_stages,
            tmp_path_factory.mktemp("logs"),
            NUM_BLOCKS,
            BLOCK_SIZE,
            extra=("--stage-channel", channel),
        )
    )
    # what the stages report (this host has /dev/shm; point-to-point between CPU stages is gloo)
    procs.channel = {"auto": "shm", "nccl": "gloo"}.get(channel, channel)
    yield procs
    for p in procs:
        p.stop()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(5, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def addresses(procs) -> list[str]:
    return [p.health_address for p in procs]


async def _stats(driver: GrpcPipelineDriver) -> list[worker_pb2.StageStats]:
    return [await v.stub.GetStats(worker_pb2.StageStatsRequest()) for v in driver.stages]


def test_chain_equals_transformers(chain, reference):
    ps = prompts()

    async def go():
        builder = PlanBuilder(BLOCK_SIZE, NUM_BLOCKS, chunk_size=7, max_batched_tokens=64, seed=3)
        driver = GrpcPipelineDriver(addresses(chain), builder, max_in_flight=3)
        await driver.connect()
        try:
            seqs = [DriverSeq(i, p, NEW_TOKENS, GREEDY, arrival_step=i) for i, p in enumerate(ps)]
            outputs = await driver.run(seqs)
            return outputs, await _stats(driver), driver
        finally:
            await driver.close()

    outputs, stats, driver = asyncio.run(go())
    diverged = sum(reference.compare(p, o).tie_divergences > 0 for p, o in zip(ps, outputs, strict=True))
    assert diverged <= 1
    assert driver.peak_in_flight >= 2
    assert max(s.peak_in_flight for s in stats) >= 2, [s.peak_in_flight for s in stats]
    assert all(s.num_failed_micro_batches == 0 and s.busy_ns > 0 for s in stats)
    # every hand-off took the chosen channel, and the stages say which
    assert [s.data_channel for s in stats] == [chain.channel] * (len(stats) - 1) + [""]
    assert [s.upstream_channel for s in stats] == [""] + [chain.channel] * (len(stats) - 1)
    # the micro-batch messages took the next stage's local socket, unless gRPC was forced
    control = "grpc" if chain.channel == "grpc" else "unix"
    assert [s.control_channel for s in stats[:-1]] == [control] * (len(stats) - 1)
    assert [s.num_local_streams > 0 for s in stats[1:]] == [control == "unix"] * (len(stats) - 1)
    sent = [{"shm": s.num_shm_sent, "grpc": s.num_grpc_sent, "gloo": s.num_p2p_sent} for s in stats[:-1]]
    assert all(n[chain.channel] > 0 and sum(n.values()) == n[chain.channel] for n in sent), sent
    mixed = [r for r in driver.builder.records if r.mixes_prefill_and_decode and len(r.entries) >= 3]
    assert mixed


def test_fork_mid_block_continues_like_transformers(chain, reference):
    prompt = prompts()[4][:21]  # 21 tokens: the second block is partly filled when forked

    async def go():
        builder = PlanBuilder(BLOCK_SIZE, NUM_BLOCKS, seed=5)
        driver = GrpcPipelineDriver(addresses(chain), builder, max_in_flight=2)
        await driver.connect()
        try:
            parent = DriverSeq(100, prompt, 10, GREEDY)
            await driver.run([parent], until=lambda: len(parent.outputs) == 1)  # prefill + 1 token
            first = parent.outputs[0]
            child = builder.fork(parent, 101)
            parent.outputs[-1], child.outputs[-1] = first, (first + 1) % 512
            await driver.run()
            return parent.outputs, child.outputs, await _stats(driver), driver
        finally:
            await driver.close()

    a, b, stats, driver = asyncio.run(go())
    assert a[0] != b[0]
    for out in (a, b):
        assert reference.compare(prompt + out[:1], out[1:]).tie_divergences == 0
    assert all(s.num_block_copies >= 1 for s in stats)
    # the last stage reports each step (the others report only failures)
    applied = [e.done.num_block_copies_applied for e in driver.stages[-1].events if e.HasField("done")]
    assert sum(applied) >= 1
    assert not any(e.HasField("done") for v in driver.stages[:-1] for e in v.events)


def _plan(mb_id: int, seq_id: int, tokens: list[int], blocks: tuple[int, ...]) -> StepPlan:
    return StepPlan(mb_id, (NewSeq(seq_id, tuple(tokens), len(tokens), 0, len(tokens), blocks, GREEDY, 0, 1),))


def test_malformed_plans_fail_alone(chain):
    async def go():
        driver = GrpcPipelineDriver(addresses(chain), PlanBuilder(BLOCK_SIZE, NUM_BLOCKS))
        await driver.connect()
        try:
            results = []
            out_of_range = plan_to_pb(_plan(1000, 1, [5, 6, 7], (NUM_BLOCKS + 7,)))
            wrong_stage = plan_to_pb(_plan(1001, 1, [5, 6, 7], (1,)), stage_index=1)
            ragged = plan_to_pb(StepPlan(1002, cached_seqs=(CachedSeq(1, 1, 0),)))
            del ragged.cached.num_scheduled[-1]
            too_many = plan_to_pb(_plan(1003, 1, [5] * 9000, tuple(range(9000 // 16 + 1))))
            # counts past uint32 in the stage's reply (issue 16: this once killed the compute loop)
            overflow = plan_to_pb(StepPlan(1005, cached_seqs=(CachedSeq(1, 2**32 - 1, 0), CachedSeq(2, 2**32 - 1, 0))))
            for mb in (out_of_range, wrong_stage, ragged, too_many, overflow):
                await driver.send(mb)
                results.append(await driver.next_result(30))
            await driver.send(plan_to_pb(_plan(1004, 2, [5, 6, 7], (4,))))
            results.append(await driver.next_result(30))
            return results
        finally:
            await driver.close()

    *failures, ok = asyncio.run(go())
    for failure, expect in zip(
        failures,
        [
            "block id 263 out of range",
            "addressed to stage 1",
            "cached columns differ in length",
            "max_num_batched_tokens",
            "max_num_batched_tokens",
        ],
        strict=True,
    ):
        assert isinstance(failure, StageFailure) and failure.stage == 0
        assert failure.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert expect in failure.message
    assert isinstance(ok, worker_pb2.MicroBatchDone) and ok.micro_batch_id == 1004
    assert len(result_from_pb(ok).sampled) == 1


@pytest.mark.parametrize("channel", ["auto", "grpc"], ids=["shm", "grpc"])
def test_killed_worker_is_seen_promptly_and_restart_shows_new_epoch(model_dir, tmp_path, channel):
    """On either channel; on shared memory the restarted stage maps a new ring (offered again)."""
    procs = start_chain(model_dir, 2, tmp_path, NUM_BLOCKS, BLOCK_SIZE, extra=("--stage-channel", channel))
    try:

        async def before_kill():
            driver = GrpcPipelineDriver(addresses(procs), PlanBuilder(BLOCK_SIZE, NUM_BLOCKS))
            await driver.connect()
            epoch = driver.stages[1].load_info.epoch
            await driver.send(plan_to_pb(_plan(1, 1, [5, 6, 7], (2,))))
            assert isinstance(await driver.next_result(30), worker_pb2.MicroBatchDone)
            killed_at = time.monotonic()
            procs[1].kill()
            failure = await driver.next_result(10)  # the driver's own stream from stage 1 breaks
            assert isinstance(failure, StageFailure) and failure.stage == 1
            assert failure.code == "UNAVAILABLE"
            seen_after = driver.stream_errors[0][1] - killed_at
            # the upstream neighbour: its next hand-off fails with UNAVAILABLE
            await driver.send(plan_to_pb(_plan(2, 2, [5, 6, 7], (3,))))
            upstream = await driver.next_result(15)
            health = await driver.stages[0].stub.Health(worker_pb2.StageHealthRequest())
            await driver.close()
            return epoch, seen_after, upstream, health

        epoch, seen_after, upstream, health = asyncio.run(before_kill())
        assert seen_after < 5.0
        assert isinstance(upstream, StageFailure) and upstream.stage == 0
        assert upstream.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "next stage" in upstream.message
        assert not health.downstream_connected

        procs[1].restart()

        async def after_restart():
            driver = GrpcPipelineDriver(addresses(procs), PlanBuilder(BLOCK_SIZE, NUM_BLOCKS))
            await driver.connect()
            try:
                new_epoch = driver.stages[1].load_info.epoch
                # stage 0 reconnects to its restarted neighbour within its backoff; a hand-off
                # before that fails with UNAVAILABLE (the scheduler replans), so try a few times
                for attempt in range(5):
                    await driver.send(plan_to_pb(_plan(3 + attempt, 3 + attempt, [5, 6, 7], (4,))))
                    result = await driver.next_result(30)
                    if isinstance(result, worker_pb2.MicroBatchDone):
                        break
                    await asyncio.sleep(1.0)
                return new_epoch, result, await _stats(driver)
            finally:
                await driver.close()

        new_epoch, result, stats = asyncio.run(after_restart())
        assert new_epoch != epoch
        assert isinstance(result, worker_pb2.MicroBatchDone) and len(result_from_pb(result).sampled) == 1
        expect = "grpc" if channel == "grpc" else "shm"
        assert (stats[0].data_channel, stats[1].upstream_channel) == (expect, expect)
    finally:
        for p in procs:
            p.stop()


def test_a_full_ring_holds_the_stage_back_and_loses_nothing(model_dir, reference, tmp_path):
    """The next stage stopped (SIGSTOP) while eight steps come: the first stage fills its
    ring's four slots, waits for a free one instead of growing it, and once the next stage
    runs again every step arrives, each with transformers' token. (The ring asked for by
    name: a run that forces another channel, PAGODA_STAGE_CHANNEL, has none to fill.)"""
    procs = start_chain(model_dir, 2, tmp_path, NUM_BLOCKS, BLOCK_SIZE, extra=("--stage-channel", "shm"))
    ps = [p[:20] for p in prompts()[2:]] + [p[:9] for p in prompts()[4:6]]  # eight prompts

    async def go():
        driver = GrpcPipelineDriver(addresses(procs), PlanBuilder(BLOCK_SIZE, NUM_BLOCKS))
        await driver.connect()
        try:
            await driver.send(plan_to_pb(_plan(9, 9, [5, 6, 7], (20,))))  # the pair connects: a ring
            assert isinstance(await driver.next_result(30), worker_pb2.MicroBatchDone)
            os.kill(procs[1].process.pid, signal.SIGSTOP)
            try:
                for i, p in enumerate(ps):
                    await driver.send(plan_to_pb(_plan(10 + i, 10 + i, p, (2 * i + 1, 2 * i + 2))))
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    stats = await driver.stages[0].stub.GetStats(worker_pb2.StageStatsRequest())
                    if stats.num_ring_full_waits and stats.num_micro_batches == len(ps) + 1:
                        break
                    await asyncio.sleep(0.2)
            finally:
                os.kill(procs[1].process.pid, signal.SIGCONT)
            results = [await driver.next_result(60) for _ in ps]
            return stats, results, await _stats(driver)
        finally:
            await driver.close()

    try:
        held, results, after = asyncio.run(go())
    finally:
        for p in procs:
            p.stop()
    assert held.data_channel == "shm" and held.num_ring_full_waits >= 1
    assert held.num_micro_batches == len(ps) + 1  # the stage computed them all; the hand-offs waited
    assert sorted(r.micro_batch_id for r in results) == [10 + i for i in range(len(ps))]
    for r in results:
        assert isinstance(r, worker_pb2.MicroBatchDone) and len(result_from_pb(r).sampled) == 1
        assert (
            reference.compare(ps[r.micro_batch_id - 10], [result_from_pb(r).sampled[0].token_id]).tie_divergences == 0
        )
    assert after[0].num_shm_sent == len(ps) + 1 and after[1].num_failed_micro_batches == 0
