"""The KV tier end to end in one process (wiring/local_engine.py: the scheduler engine, the KV
manager's tier index, every stage's KVTierStore): a prefix evicted from the pool to the host and
disk tiers is served from them with the output of computing it, a corrupt tier file is detected
and the prompt recomputed, and the tiers never exceed their bounds."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.reference import HFReference

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.request import Request, SamplingOptions
from wiring.local_engine import build_local_engine

BS = 16
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Session:
    """One engine kept across rounds (the tier outlives requests), each round's requests together."""

    def __init__(self, model_dir, tmp_path, offload: str, pp: int = 2, num_kv_blocks: int = 16) -> None:
        spec = offload.replace("DIR", str(tmp_path / "tier"))
        config = SchedulerConfig(
            block_size=BS,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=64,
            pipeline_parallel_size=pp,
            kv_offload=spec,
            async_scheduling=False,
        )
        self.engine = build_local_engine(model_dir, config, num_kv_blocks=num_kv_blocks, dtype="float32")
        self.n = 0

    async def round(self, prompts: list[list[int]]) -> list[list[int]]:
        requests = []
        for p in prompts:
            self.n += 1
            requests.append(Request(f"r{self.n}", tuple(p), GREEDY, 0.0))

        async def collect(stream):
            tokens, final = [], None
            async for out in stream:
                for d in out.deltas:
                    tokens.extend(d.token_ids)
                final = out
            assert final.finished and final.error is None, final.error
            return tokens

        return list(await asyncio.gather(*(collect(self.engine.submit(r)) for r in requests)))

    def stores(self):
        return [r.kv_tier for r in self.engine.transport.runners]


def test_an_evicted_prefix_is_served_from_the_host_and_disk_tiers_exactly(model_dir, reference, tmp_path):
    a, others = prompt(1, 70), [prompt(s, 100) for s in (2, 3, 4)]

    async def scenario():
        s = Session(model_dir, tmp_path, "host:3b,disk:DIR:8b")
        await s.engine.start()
        try:
            first = (await s.round([a]))[0]
            for other in others:  # each fills most of the 16-block pool: a's blocks go below it
                await s.round([other])
            again = (await s.round([a]))[0]
            stats = await s.engine.kv.stats()
            for store in s.stores():
                store.check_integrity()
                assert store.num_host_blocks <= 3 and store.num_disk_blocks <= 8
            # the scheduler counts prefix hits as the KV service does: tier loads apart
            assert s.engine.planner.num_prefix_hit_tokens == stats.num_prefix_hit_tokens
            return first, again, stats, [(st.num_loaded_host, st.num_loaded_disk) for st in s.stores()]
        finally:
            await s.engine.stop()

    first, again, stats, loads = asyncio.run(scenario())
    assert again == first
    assert reference.compare(a, again).tie_divergences == 0
    assert stats.num_tier_hit_tokens >= 3 * BS and stats.num_tier_demotions > 0
    assert stats.tier_host_blocks <= 3 and stats.tier_disk_blocks <= 8
    assert all(host + disk == stats.num_tier_loads for host, disk in loads)  # every stage loaded each
    assert all(disk > 0 for _, disk in loads)  # some came from the disk tier


def test_a_corrupt_tier_file_is_detected_and_the_prompt_recomputed(model_dir, reference, tmp_path):
    a, others = prompt(5, 70), [prompt(s, 100) for s in (6, 7, 8)]

    async def scenario():
        s = Session(model_dir, tmp_path, "host:1b,disk:DIR:12b")
        await s.engine.start()
        try:
            first = (await s.round([a]))[0]
            for other in others:
                await s.round([other])
            files = sorted((tmp_path / "tier").rglob("*.kv"))
            assert files, "nothing reached the disk tier"
            for f in files:  # flip a byte of every block's payload, and cut one short
                data = bytearray(f.read_bytes())
                data[-5] ^= 0xFF
                f.write_bytes(bytes(data))
            files[0].write_bytes(files[0].read_bytes()[:-100])
            again = (await s.round([a]))[0]
            stats = await s.engine.kv.stats()
            corrupt = sum(st.num_corrupt for st in s.stores())
            return first, again, stats, corrupt
        finally:
            await s.engine.stop()

    first, again, stats, corrupt = asyncio.run(scenario())
    assert again == first  # recomputed: never served from a corrupt block
    assert reference.compare(a, again).tie_divergences == 0
    assert corrupt > 0 and stats.num_tier_drops > 0


def test_a_stage_without_a_tier_refuses_a_plan_that_moves_blocks(model_dir):
    """A KV service with a tier and a stage without one (a flag forgotten): the stage refuses
    the plan before changing anything, rather than take unloaded blocks for computed KV."""
    from services.step import TIER_DROP, StepPlan, TierOp
    from worker_svc.errors import InvalidPlanError

    config = SchedulerConfig(block_size=BS, num_kv_blocks=8)
    engine = build_local_engine(model_dir, config, num_kv_blocks=8, dtype="float32")
    runner = engine.transport.runners[0]
    with pytest.raises(InvalidPlanError, match="has none"):
        runner.execute(StepPlan(1, tier_ops=(TierOp(TIER_DROP, b"k"),)))
