"""The KV service killed mid-run and restarted: no request is lost, none changes its output.

Real processes on loopback (scheduler, KV service, 2 stage workers). The same prompts run
twice through the same stack: once undisturbed, once with the KV service SIGKILLed while
they generate and restarted by the launcher's supervisor. The scheduler must preempt what
was running, reset the (new) KV service, prefill again and finish every request with the
tokens of the undisturbed run.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
from support.reference import HFReference
from support.stack import kill_stack

from services.grpc_utils import aio_channel
from services.pb import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from wiring.launcher import start_stack

NUM_KV_BLOCKS = 64  # of 16 slots: 8 requests of up to ~240 tokens do not all fit at once
BLOCK_SIZE = 16
MAX_TOKENS = 150
NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kv-failure-logs")
    trace = logs / "trace.jsonl"
    s = start_stack(
        model_dir,
        num_stages=2,
        num_kv_blocks=NUM_KV_BLOCKS,
        block_size=BLOCK_SIZE,
        log_dir=logs,
        scheduler_args=("--max-num-batched-tokens", "256", "--max-num-seqs", "16"),
        env={"PAGODA_TRACE_SCHEDULER": "1", "PAGODA_TRACE_FILE": str(trace)},
        threads_per_worker=1,
    )
    s.trace_path = trace
    yield s
    kill_stack(s)  # the graceful stop is not tested here


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [rng.choice([3, 16, 17, 40, 90]) for _ in range(n)]
    return [torch.randint(5, 512, (length,), generator=g).tolist() for length in lengths]


async def generate(stub, prompt: list[int]) -> tuple[list[int], scheduler_pb2.GenerateResponse]:
    req = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt)
    req.sampling_params.max_tokens = MAX_TOKENS
    req.sampling_params.temperature = 0.0
    req.sampling_params.ignore_eos = True
    tokens: list[int] = []
    last = None
    async for resp in stub.Generate(req):
        assert resp.index == 0
        tokens.extend(resp.token_ids)
        last = resp
    return tokens, last


async def get_stats(stub) -> scheduler_pb2.GetStatsResponse:
    return await stub.GetStats(scheduler_pb2.GetStatsRequest())


def trace_events(stack) -> list[dict]:
    return [json.loads(line) for line in stack.trace_path.read_text().splitlines()]


def test_kv_service_killed_and_restarted_mid_run_loses_no_request(stack, model_dir):
    work = prompts(NUM_REQUESTS)

    async def undisturbed():
        async with aio_channel(stack.scheduler_address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            return await asyncio.wait_for(asyncio.gather(*(generate(stub, p) for p in work)), 120)

    async def with_kv_failure():
        async with aio_channel(stack.scheduler_address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            before = await get_stats(stub)
            tasks = [asyncio.create_task(generate(stub, p)) for p in work]
            at_kill = before
            for _ in range(400):  # kill once generation is well under way
                await asyncio.sleep(0.025)
                at_kill = await get_stats(stub)
                if at_kill.num_generated_tokens - before.num_generated_tokens > 300:
                    break
            stack.kvcache.kill()
            restarted = await asyncio.to_thread(stack.supervise_once)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            after = await get_stats(stub)
            for _ in range(20):  # freed blocks reach the KV service with the next Step
                if after.kv_cache.num_used_blocks == 0:
                    break
                await asyncio.sleep(0.1)
                after = await get_stats(stub)
            return before, at_kill, restarted, results, after

    trace_start = len(trace_events(stack)) if stack.trace_path.exists() else 0
    baseline = asyncio.run(undisturbed())
    before, at_kill, restarted, results, after = asyncio.run(with_kv_failure())

    # the kill landed mid-generation, with every request still running
    assert restarted == ["kvcache"]
    assert at_kill.num_finished_requests == before.num_finished_requests
    assert 300 < at_kill.num_generated_tokens - before.num_generated_tokens < NUM_REQUESTS * MAX_TOKENS
    assert at_kill.kv_cache.num_used_blocks > 0
    events = trace_events(stack)[trace_start:]
    resets = [e for e in events if e["event"] == "reset"]
    assert resets and resets[-1]["preempted"], "the kill should have caught requests running"
    assert "KV service" in resets[-1]["reason"]
    assert any(e["event"] == "recovered" for e in events)

    # every request finished with the greedy tokens of the undisturbed run, both as
    # transformers has them (where a different batch flipped a near-tie, the tie rule decides)
    reference = HFReference(model_dir)
    num_tie_divergences = 0
    for i, (prompt, (want, _), (got, last)) in enumerate(zip(work, baseline, results, strict=True)):
        assert len(got) == MAX_TOKENS
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.num_prompt_tokens == len(prompt)
        for run, tokens in (("undisturbed", want), ("with the KV failure", got)):
            try:
                num_tie_divergences += reference.compare(prompt, tokens).tie_divergences
            except AssertionError as exc:
                raise AssertionError(f"request {i}, {run} run: {exc}") from None
    assert num_tie_divergences <= 2
    assert sum(got != want for (want, _), (got, _) in zip(baseline, results, strict=True)) <= 2

    # afterwards: a new KV service, healthy, holding no block for anyone
    assert after.num_finished_requests - before.num_finished_requests == NUM_REQUESTS
    assert after.kv_health == common_pb2.HEALTH_STATUS_SERVING
    assert after.health == common_pb2.HEALTH_STATUS_SERVING
    assert after.kv_cache.epoch != before.kv_cache.epoch
    assert after.kv_cache.num_used_blocks == 0
    assert after.num_running == 0 and after.num_waiting == 0
