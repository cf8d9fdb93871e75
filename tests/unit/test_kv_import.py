"""P/D disaggregation's import level in the decode replica's KV manager (kvcache_svc/core/tier.py
`plan_import`, `commit_import`; issue 39): which blocks a decode replica pulls, how committed
keys become tier hits loaded by the admitting step (and consumed), expiry, bounds, failures."""

from __future__ import annotations

import asyncio

import pytest

from kvcache_svc.client import InProcessKVCacheClient
from kvcache_svc.core import Allocated, KVCacheManager, NewSequence, StepInput
from kvcache_svc.core.tier import IMPORT_TTL_S, TierIndex, plan_import, tier_for
from services.kv_errors import ImportUnavailable
from services.step import TIER_DROP, TIER_LOAD

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def manager(import_blocks=8, host=0, num_blocks=32, clock=None):
    tier = TierIndex(host, 0, None, import_blocks, clock or Clock())
    return KVCacheManager(num_blocks, BS, watermark=0.0, tier=tier)


def plan(m, tokens, num_blocks):
    cache, tier = m.import_level()
    return plan_import(cache, tier, None, tuple(tokens), num_blocks, BS)


def step(m, mb, news=(), frees=()):
    out = m.step(StepInput(new_sequences=news, micro_batch_id=mb, frees=frees))
    m.complete([mb])
    m.check_integrity()
    return out


def test_the_prompts_full_blocks_before_the_last_token_are_pulled_and_loaded_by_the_admitting_step():
    m = manager()
    prompt = list(range(100, 100 + 5 * BS + 2))  # 5 full blocks and 2 tokens
    indices, keys, present = plan(m, prompt, 99)
    assert indices == [0, 1, 2, 3, 4] and present == 0 and len(set(keys)) == 5
    assert plan(m, prompt[: 5 * BS], 99)[0] == [0, 1, 2, 3]  # the last token's block is computed
    assert plan(m, prompt, 2)[0] == [0, 1]  # no more than the source holds
    _, tier = m.import_level()
    assert tier.commit_import(keys) == 5 and tier.num_import == 5
    out = step(m, 1, news=[NewSequence(1, prompt)])
    result = out.results[1]
    assert isinstance(result, Allocated) and result.num_computed_tokens == 5 * BS and result.num_new_tokens == 2
    loads = [op for op in out.tier_ops if op.kind == TIER_LOAD]
    table = m.block_table(1)
    assert [op.key for op in loads] == keys and [op.block_id for op in loads] == list(table[:5])
    assert tier.num_import == 0 and tier.num_import_loads == 5  # consumed
    assert m.stats().num_tier_hit_tokens == 5 * BS
    # the loaded blocks are the pool's cached prefix now: a second prompt pulls nothing
    assert plan(m, prompt, 99) == ([], [], 5)


def test_blocks_already_cached_or_in_the_tier_are_not_pulled_again():
    m = manager(host=4)
    prompt = list(range(7, 7 + 6 * BS + 1))
    step(m, 1, news=[NewSequence(1, prompt[: 2 * BS + 1])])  # blocks 0, 1 cached
    step(m, 2, frees=[1])
    indices, keys, present = plan(m, prompt, 99)
    assert present == 2 and indices == [2, 3, 4, 5]
    m.import_level()[1].commit_import(keys[:1])
    indices2, _, present2 = plan(m, prompt, 99)
    assert present2 == 3 and indices2 == [3, 4, 5]


def test_unloaded_imports_expire_and_the_stages_hear_a_drop():
    clock = Clock()
    m = manager(clock=clock)
    _, keys, _ = plan(m, list(range(3 * BS + 1)), 9)
    tier = m.import_level()[1]
    tier.commit_import(keys)
    clock.now = IMPORT_TTL_S - 1
    assert not [op for op in step(m, 1, news=[NewSequence(1, [9, 9])]).tier_ops if op.kind == TIER_DROP]
    clock.now = IMPORT_TTL_S + 1
    drops = [op.key for op in step(m, 2, news=[NewSequence(2, [8, 8])]).tier_ops if op.kind == TIER_DROP]
    assert drops == keys and tier.num_import == 0 and tier.num_import_expired == 3


def test_the_import_level_is_bounded_and_a_failed_pull_is_forgotten_on_every_stage():
    m = manager(import_blocks=3)
    _, keys, _ = plan(m, list(range(6 * BS + 1)), 9)
    assert len(keys) == 3  # never more than the level holds
    tier = m.import_level()[1]
    tier.commit_import(keys)
    _, more, _ = plan(m, list(range(50, 50 + 2 * BS + 1)), 9)
    tier.commit_import(more)  # the oldest make room
    assert tier.num_import == 3
    tier.forget(more)
    drops = [op.key for op in step(m, 1, news=[NewSequence(1, [1, 2])]).tier_ops if op.kind == TIER_DROP]
    assert set(drops) == set(keys[:2]) | set(more)
    assert tier.num_import == 1


def test_no_import_level_is_refused_clearly():
    with pytest.raises(ImportUnavailable, match="kv-import-blocks"):
        KVCacheManager(8, BS).import_level()
    with pytest.raises(ImportUnavailable):
        KVCacheManager(8, BS, tier=TierIndex(2)).import_level()
    assert tier_for("", None, 0) is None and tier_for("", None, 16).import_blocks == 16
    with pytest.raises(ValueError, match="host_blocks"):
        TierIndex(0)


def test_the_in_process_client_plans_commits_and_forgets():
    asyncio.run(_client_round())


async def _client_round():
    m = manager()
    client = InProcessKVCacheClient(m)
    prompt = list(range(2 * BS + 3))
    indices, keys, present, held, capacity = await client.import_plan(None, prompt, 5)
    assert indices == [0, 1] and present == 0 and (held, capacity) == (0, 8)
    await client.commit_import(keys)
    assert (await client.import_plan(None, prompt, 5)) == ([], [], 2, 2, 8)  # (the level holds 2 now)
    await client.forget_import(keys)
    assert (await client.import_plan(None, prompt, 5))[0] == [0, 1]
    with pytest.raises(ImportUnavailable):
        await InProcessKVCacheClient(KVCacheManager(8, BS)).import_plan(None, prompt, 5)


def test_a_loaded_import_keeps_its_room_until_the_step_that_loads_it_completes():
    m = manager(import_blocks=4)
    prompt = list(range(30, 30 + 3 * BS + 1))
    _, keys, _ = plan(m, prompt, 9)
    tier = m.import_level()[1]
    tier.commit_import(keys)
    m.step(StepInput(new_sequences=[NewSequence(1, prompt)], micro_batch_id=1))
    assert tier.num_import == 3  # the stages free the blocks as they apply the step, not before
    m.complete([1])
    assert tier.num_import == 0
    other = list(range(80, 80 + 3 * BS + 1))
    _, keys2, _ = plan(m, other, 9)
    tier.commit_import(keys2)  # a failed step: its keys are dropped from the stages
    m.step(StepInput(new_sequences=[NewSequence(2, other)], micro_batch_id=2))
    assert tier.num_import == 3
    m.fail([2])
    assert tier.num_import == 0
    m.check_integrity()
