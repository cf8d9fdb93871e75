"""P/D disaggregation through real processes (issue 39): a prefill replica (p0) and a decode
replica (d0), each a KV service, two stage workers and a scheduler, behind a gateway started
with `--scheduler d0=... --prefill-scheduler p0=...`.

- Concurrent requests of mixed lengths through the gateway (the official `openai` client):
  greedy output equals the same prompts computed whole on one replica and transformers'; the
  decode replica loaded the long prompts' blocks from its import level instead of computing
  them; once answered, neither replica holds a KV block.
- The prefill replica's stages killed while a burst is being prefilled and pulled: every
  request is answered (computed on the decode side), and neither KV service holds a block.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from support.reference import HFReference
from support.stack import kill_stack, kill_tree
from test_scheduler_stack import generate, stats

from services.grpc_utils import aio_channel
from services.pb import scheduler_pb2_grpc
from wiring.launcher import ServiceProcess, free_port, pagoda_command, start_stack

BLOCK = 16
NUM_KV_BLOCKS = 96
IMPORT_BLOCKS = 64
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFReference(model_dir)


def _stack(model_dir, log_dir, *extra):
    return start_stack(
        model_dir,
        num_stages=2,
        num_kv_blocks=NUM_KV_BLOCKS,
        block_size=BLOCK,
        log_dir=log_dir,
        threads_per_worker=1,
        kvcache_args=extra,
        worker_args=extra,
        scheduler_args=("--max-num-seqs", "8", "--max-model-len", "1024", "--max-num-batched-tokens", "256"),
    )


@pytest.fixture(scope="module")
def replicas(model_dir, tmp_path_factory):
    stacks = {}
    try:
        stacks["p0"] = _stack(model_dir, tmp_path_factory.mktemp("p0"))
        stacks["d0"] = _stack(model_dir, tmp_path_factory.mktemp("d0"), "--kv-import-blocks", str(IMPORT_BLOCKS))
        yield stacks
    finally:
        for s in stacks.values():
            kill_stack(s)


@pytest.fixture(scope="module")
def gateway(model_dir, replicas, tmp_path_factory):
    port, grpc_port = free_port(), free_port()
    g = ServiceProcess(
        "gateway",
        pagoda_command(
            "gateway",
            "--model",
            model_dir,
            "--scheduler",
            f"d0={replicas['d0'].scheduler_address}",
            "--prefill-scheduler",
            f"p0={replicas['p0'].scheduler_address}",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--max-model-len",
            "1024",
            "--served-model-name",
            "tiny",
        ),
        f"127.0.0.1:{grpc_port}",
        log_path=tmp_path_factory.mktemp("gateway") / "gateway.log",
    )
    g.start()
    g.wait_healthy(60)
    g.port = port
    yield g
    g.stop()


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in lengths]


def complete_all(port: int, batch: list[list[int]], concurrency: int = 0) -> list[list[int]]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)

    def one(p):
        r = client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return r.choices[0].token_ids

    with ThreadPoolExecutor(concurrency or len(batch)) as pool:
        return list(pool.map(one, batch))


def direct(address: str, batch: list[list[int]]) -> list[list[int]]:
    async def go():
        async with aio_channel(address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            return [(await generate(stub, p, MAX_TOKENS))[0][0] for p in batch]

    return asyncio.run(go())


def kv_stats(stack):
    return asyncio.run(stats(stack.scheduler_address)).kv_cache


def wait_no_blocks(stack, timeout_s: float = 45.0) -> int:
    """The pool's blocks in use once holds are released (the gateway releases after the decode
    side's first response; a hold nobody releases ends by itself after 30 s)."""
    deadline = time.monotonic() + timeout_s
    used = kv_stats(stack).num_used_blocks
    while used and time.monotonic() < deadline:
        time.sleep(0.5)
        used = kv_stats(stack).num_used_blocks
    return used


def test_disaggregated_output_equals_the_aggregated_stack_and_nothing_leaks(replicas, gateway, reference):
    batch = prompts(1, [5, 20, 40, 70, 100, 150, 260, 33])
    before = kv_stats(replicas["d0"]).num_tier_hit_tokens
    got = complete_all(gateway.port, batch)
    imported = kv_stats(replicas["d0"]).num_tier_hit_tokens - before
    # every prompt of at least 33 tokens: its full blocks before the last token's, pulled
    expected = sum((len(p) - 1) // BLOCK * BLOCK for p in batch if len(p) >= 33)
    assert imported == expected, (imported, expected)
    aggregated = direct(replicas["p0"].scheduler_address, batch)  # one replica computes all
    assert got == aggregated
    for p, out in zip(batch, got, strict=True):
        assert reference.compare(p, out).tie_divergences == 0
    assert wait_no_blocks(replicas["p0"]) == 0
    assert wait_no_blocks(replicas["d0"]) == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.port}/debug/replicas", timeout=10) as r:
        prefill = json.loads(r.read())["prefill"]
    long_prompts = sum(len(p) >= 33 for p in batch)
    assert prefill["num_prefilled"] == long_prompts and prefill["num_local"] == len(batch) - long_prompts
    assert prefill["num_released"] == long_prompts and prefill["replicas"][0]["name"] == "p0"


def test_a_burst_larger_than_the_import_area_waits_its_turn_instead_of_recomputing(replicas, gateway, reference):
    batch = prompts(3, [300] * 8)  # 18 blocks each to pull: 144 against an area of 64
    before = asyncio.run(stats(replicas["d0"].scheduler_address)).disaggregation
    got = complete_all(gateway.port, batch)
    after = asyncio.run(stats(replicas["d0"].scheduler_address)).disaggregation
    assert after.num_imported - before.num_imported == len(batch)
    assert after.num_import_failures == before.num_import_failures
    assert after.num_imported_blocks - before.num_imported_blocks == len(batch) * (299 // BLOCK)
    for p, out in zip(batch, got, strict=True):
        assert reference.compare(p, out).tie_divergences == 0
    assert wait_no_blocks(replicas["d0"]) == 0


def test_the_prefill_replica_killed_mid_transfer_leaves_every_request_answered_and_no_block_held(
    replicas, gateway, reference
):
    batch = prompts(2, [300, 280, 260, 240, 220, 200, 180, 160] * 3)
    d0 = replicas["d0"]
    before = asyncio.run(stats(d0.scheduler_address)).disaggregation
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(complete_all, gateway.port, batch, 4)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the first pulls have landed: the rest are under way
            now = asyncio.run(stats(d0.scheduler_address)).disaggregation
            if now.num_imported - before.num_imported >= 2:
                break
            time.sleep(0.02)
        for worker in replicas["p0"].workers:
            kill_tree(worker)
        results = future.result(timeout=300)
    after = asyncio.run(stats(d0.scheduler_address)).disaggregation
    imported = after.num_imported - before.num_imported
    print(f"\n[pd] {imported} of {len(batch)} prompts pulled before and while the prefill stages died")
    assert 2 <= imported < len(batch)
    for p, out in zip(batch, results, strict=True):
        assert reference.compare(p, out).tie_divergences == 0
    assert wait_no_blocks(d0) == 0
    # the prefill replica's scheduler reset its KV service when its stages went
    assert asyncio.run(_kv_used(replicas["p0"])) == 0


async def _kv_used(stack) -> int:
    from services.kv_client import GrpcKVCacheClient

    client = GrpcKVCacheClient(stack.kvcache.health_address)
    try:
        deadline = time.monotonic() + 30
        used = (await client.stats()).num_used_blocks
        while used and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            used = (await client.stats()).num_used_blocks
        return used
    finally:
        await client.close()
