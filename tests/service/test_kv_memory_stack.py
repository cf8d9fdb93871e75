"""A stack whose KV pool is sized from memory (issue 14): every stage profiles and reports,
the KV service and the scheduler get the smallest stage's pool, a restarted stage holds
that pool, and requests run on it."""

from __future__ import annotations

import asyncio
import os

from support.stack import kill_stack

from services.grpc_utils import aio_channel
from services.pb import scheduler_pb2, scheduler_pb2_grpc
from wiring.kv_pool import MemorySetting
from wiring.launcher import stage_load_infos, start_stack


def test_a_stack_sized_from_memory(model_factory, tmp_path):
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = min(1.0, 2 * (1 << 30) / total)  # about 1 GiB for each of the 2 stages
    stack = start_stack(
        model_factory(arch="llama"),
        num_stages=2,
        num_kv_blocks=None,
        block_size=16,
        log_dir=tmp_path,
        threads_per_worker=1,
        memory=MemorySetting(gpu_memory_utilization=share, max_model_len=512),
    )
    try:
        infos = stage_load_infos(stack.workers, {})
        for info in infos:
            assert info.memory_total_bytes == total
            assert info.memory_budget_bytes == int(share / 2 * total)
            assert (
                info.num_kv_blocks
                == (info.memory_budget_bytes - info.memory_baseline_bytes - info.activation_peak_bytes)
                // info.kv_block_bytes
            )
        assert stack.num_kv_blocks == min(i.num_kv_blocks for i in infos)
        assert all(f"--num-kv-blocks {stack.num_kv_blocks}" in " ".join(w.command) for w in stack.workers)

        async def run():
            async with aio_channel(stack.scheduler_address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                stats = await stub.GetStats(scheduler_pb2.GetStatsRequest())
                req = scheduler_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7])
                req.sampling_params.max_tokens = 8
                req.sampling_params.ignore_eos = True
                tokens = [t async for r in stub.Generate(req) for t in r.token_ids]
                return stats, tokens

        stats, tokens = asyncio.run(run())
        assert stats.kv_cache.num_total_blocks == stack.num_kv_blocks and len(tokens) == 8
        assert f"KV cache: {stack.num_kv_blocks} blocks" in (tmp_path / "scheduler.log").read_text()
    finally:
        kill_stack(stack)  # the graceful stop is not tested here
