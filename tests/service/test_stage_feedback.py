"""Sampled-token feedback between real stage processes: the last stage streams each step's
tokens straight to the first (`--feedback`), so a step can be sent before its input token
exists (a placeholder step) and the first stage feeds it without a scheduler round trip."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.driver import PlanBuilder
from support.grpc_driver import GrpcPipelineDriver, StageFailure
from support.reference import HFReference
from support.workers import start_chain

from services.pb import worker_pb2
from services.sampling import SamplingParams
from services.step import CachedSeq, NewSeq, StepPlan
from services.step_codec import plan_to_pb, result_from_pb

BLOCK_SIZE = 16
NUM_BLOCKS = 128
GREEDY = SamplingParams(temperature=0.0)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def chain(model_dir, tmp_path_factory):
    procs = start_chain(model_dir, 2, tmp_path_factory.mktemp("logs"), NUM_BLOCKS, BLOCK_SIZE)
    yield procs
    for p in procs:
        p.stop()


async def _connected_driver(chain) -> GrpcPipelineDriver:
    """A driver, once the last stage's feedback stream into the first is open."""
    driver = GrpcPipelineDriver([p.health_address for p in chain], PlanBuilder(BLOCK_SIZE, NUM_BLOCKS))
    await driver.connect()
    for _ in range(200):
        if (await driver.stages[0].stub.LoadInfo(worker_pb2.LoadInfoRequest())).feedback_connected:
            return driver
        await asyncio.sleep(0.05)
    raise AssertionError("the feedback stream did not open")


def _new(seq_id: int, prompt: list[int], blocks: range, scheduled: int | None = None) -> NewSeq:
    return NewSeq(seq_id, tuple(prompt), len(prompt), 0, scheduled or len(prompt), tuple(blocks), GREEDY)


def _timing(driver: GrpcPipelineDriver, stage: int, mb_id: int):
    """A stage's timing of a step, as the last stage reports every stage's."""
    for event in driver.stages[-1].events:
        if event.HasField("done") and event.done.micro_batch_id == mb_id:
            for t in (*event.done.upstream_timings, event.done.timing):
                if t.stage_index == stage:
                    return t
    raise AssertionError(f"no timing of step {mb_id} from stage {stage}")


def test_placeholder_steps_are_fed_by_the_last_stage_and_equal_transformers(chain, model_dir):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 512, (n,), generator=g).tolist() for n in (5, 17, 40)]
    ids = [11, 12, 13]

    async def go():
        driver = await _connected_driver(chain)
        try:
            assert driver.stages[1].load_info.feedback_address == chain[0].health_address
            before = await driver.stages[0].stub.GetStats(worker_pb2.StageStatsRequest())
            # step 1 prefills and samples; step k + 1 goes out before step k's tokens exist
            # (it carries no token: the first stage waits for the last stage's feedback)
            await driver.send(
                plan_to_pb(
                    StepPlan(
                        1,
                        new_seqs=tuple(
                            _new(i, p, range(8 * k, 8 * k + 8))
                            for k, (i, p) in enumerate(zip(ids, prompts, strict=True))
                        ),
                    )
                )
            )
            decode = [CachedSeq(i, 1, 8) for i in ids]
            encoded = plan_to_pb(StepPlan(2, cached_seqs=tuple(decode)))
            assert not encoded.cached.new_token_ids and not encoded.new_seqs  # no tokens, no params
            await driver.send(encoded)
            outputs = {i: [] for i in ids}
            for step in range(1, NEW_TOKENS + 1):
                result = await driver.next_result()
                assert not isinstance(result, StageFailure), result
                assert result.micro_batch_id == step
                for t in result_from_pb(result).sampled:
                    outputs[t.seq_id].append(t.token_id)
                if step + 2 <= NEW_TOKENS:
                    await driver.send(plan_to_pb(StepPlan(step + 2, cached_seqs=tuple(decode))))
            after = await driver.stages[0].stub.GetStats(worker_pb2.StageStatsRequest())
            return driver, outputs, before, after
        finally:
            await driver.close()

    driver, outputs, before, after = asyncio.run(go())
    reference = HFReference(model_dir)
    for i, prompt in zip(ids, prompts, strict=True):
        assert len(outputs[i]) == NEW_TOKENS
        assert reference.compare(prompt, outputs[i]).tie_divergences == 0
    # every token after the first came to the first stage by feedback, not in a plan
    assert after.num_fed_tokens - before.num_fed_tokens == len(ids) * (NEW_TOKENS - 1)
    assert after.num_feedback_waits > before.num_feedback_waits
    # stage 0 received step k + 1 before the last stage had computed step k: no round trip
    early = [
        k for k in range(1, NEW_TOKENS) if _timing(driver, 0, k + 1).received_ns < _timing(driver, 1, k).compute_end_ns
    ]
    assert len(early) >= NEW_TOKENS // 2, early


def test_a_step_whose_input_never_comes_fails_on_abandon_or_reset(chain, model_dir):
    prompt = list(range(20, 30))

    async def go():
        driver = await _connected_driver(chain)
        try:
            epoch = driver.stages[0].load_info.epoch
            # computes 9 of 10 prompt tokens (no sample), then a step past the known tokens:
            # nothing will ever sample its input, so it waits
            await driver.send(plan_to_pb(StepPlan(1, new_seqs=(_new(21, prompt, range(2), 9),))))
            await driver.send(plan_to_pb(StepPlan(2, cached_seqs=(CachedSeq(21, 2, 2),))))
            done = await driver.next_result()  # step 1 (no samples) completes
            assert done.micro_batch_id == 1
            with pytest.raises(asyncio.TimeoutError):
                await driver.next_result(timeout_s=0.5)  # step 2 waits
            await driver.stages[0].stub.Abandon(worker_pb2.AbandonRequest(epoch=epoch + 1, seq_ids=[21]))
            with pytest.raises(asyncio.TimeoutError):  # another epoch's word is ignored
                await driver.next_result(timeout_s=0.3)
            await driver.stages[0].stub.Abandon(worker_pb2.AbandonRequest(epoch=epoch, seq_ids=[21]))
            abandoned = await driver.next_result()
            # a waiting step also gives up when a reset follows it
            await driver.send(plan_to_pb(StepPlan(3, new_seqs=(_new(22, prompt, range(2, 4), 9),))))
            await driver.send(plan_to_pb(StepPlan(4, cached_seqs=(CachedSeq(22, 2, 2),))))
            await driver.send(plan_to_pb(StepPlan(5, new_seqs=(_new(23, prompt, range(4, 6)),), reset=True)))
            outcomes = sorted([await driver.next_result() for _ in range(3)], key=lambda r: r.micro_batch_id)
            stats = await driver.stages[0].stub.GetStats(worker_pb2.StageStatsRequest())
            return abandoned, outcomes, stats
        finally:
            await driver.close()

    abandoned, (three, four, five), stats = asyncio.run(go())
    assert isinstance(abandoned, StageFailure) and abandoned.micro_batch_id == 2
    assert abandoned.stage == 0 and "will not come" in abandoned.message
    assert three.micro_batch_id == 3
    assert isinstance(four, StageFailure) and four.micro_batch_id == 4 and "reset" in four.message
    assert five.micro_batch_id == 5 and len(result_from_pb(five).sampled) == 1  # the stage kept serving
    assert stats.num_abandoned >= 2
