"""The KV tier through real processes (issue 39): a KV service, two stage workers and the
scheduler started with `--kv-offload` (in blocks, as `pagoda serve` hands it on). Prompts evicted
from the pool come back from the host and disk tiers with the output they had when computed;
a stage's tier files corrupted on disk are detected and the prompt recomputed; the tiers stay
within their bounds; nothing leaks."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.reference import HFReference
from support.stack import kill_stack
from test_scheduler_stack import generate, stats

from services.grpc_utils import aio_channel
from services.pb import scheduler_pb2_grpc
from wiring.launcher import start_stack

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 24
HOST, DISK = 4, 32


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def tier_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-tier")


@pytest.fixture(scope="module")
def stack(model_dir, tier_dir, tmp_path_factory):
    offload = ("--kv-offload", f"host:{HOST}b,disk:{tier_dir}:{DISK}b")
    s = start_stack(
        model_dir,
        num_stages=2,
        num_kv_blocks=NUM_KV_BLOCKS,
        block_size=BLOCK_SIZE,
        log_dir=tmp_path_factory.mktemp("tier-logs"),
        scheduler_args=("--max-num-batched-tokens", "128", *offload),
        worker_args=offload,
        kvcache_args=offload,
        threads_per_worker=1,
    )
    yield s
    kill_stack(s)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_by_one(address, prompts, max_tokens=6):
    async def go():
        async with aio_channel(address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            return [(await generate(stub, p, max_tokens))[0][0] for p in prompts]

    return asyncio.run(go())


def test_evicted_prefixes_come_back_from_the_tiers_and_corrupt_files_are_recomputed(stack, reference, tier_dir):
    a, b = prompt(11, 100), prompt(12, 100)
    fillers = [prompt(s, 300) for s in (13, 14)]  # each most of the 24-block pool
    first = one_by_one(stack.scheduler_address, [a, b, *fillers])
    again = one_by_one(stack.scheduler_address, [a])
    kv = asyncio.run(stats(stack.scheduler_address)).kv_cache
    assert again[0] == first[0] and reference.compare(a, again[0]).tie_divergences == 0
    assert kv.num_tier_hit_tokens >= 4 * BLOCK_SIZE and kv.num_tier_demotions > 0
    assert kv.tier_host_blocks <= HOST and kv.tier_disk_blocks <= DISK
    files = sorted(tier_dir.rglob("*.kv"))
    assert files and len({f.parent for f in files}) == 2  # each stage its own folder
    assert all(len(list(d.glob("*.kv"))) <= DISK for d in {f.parent for f in files})
    for f in files:  # b's blocks among them: every one corrupted on one stage's disk
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x5A
        f.write_bytes(bytes(data))
    again_b = one_by_one(stack.scheduler_address, [b])
    after = asyncio.run(stats(stack.scheduler_address)).kv_cache
    assert again_b[0] == first[1] and reference.compare(b, again_b[0]).tie_divergences == 0
    assert after.num_tier_drops > kv.num_tier_drops  # the step failed, its keys forgotten
    assert after.num_used_blocks == 0
