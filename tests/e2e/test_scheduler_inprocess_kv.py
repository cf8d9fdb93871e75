"""`pagoda scheduler --kvcache in-process`: the embedded KV manager, one process less."""

from __future__ import annotations

import asyncio

from support.reference import HFReference
from support.workers import start_chain

from services.grpc_utils import aio_channel
from services.pb import scheduler_pb2, scheduler_pb2_grpc
from wiring.launcher import ServiceProcess, free_port, pagoda_command


def test_scheduler_with_in_process_kv(model_factory, tmp_path):
    model_dir = model_factory(arch="llama")
    workers = start_chain(model_dir, 1, tmp_path, num_kv_blocks=64, block_size=16)
    port = free_port()
    scheduler = ServiceProcess(
        "scheduler",
        pagoda_command(
            "scheduler",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--kvcache",
            "in-process",
            "--stages",
            workers[0].health_address,
            "--num-kv-blocks",
            "64",
        ),
        f"127.0.0.1:{port}",
        log_path=tmp_path / "scheduler.log",
    )
    try:
        scheduler.start()
        scheduler.wait_healthy(60)
        prompt = list(range(5, 40))

        async def go():
            async with aio_channel(scheduler.health_address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                req = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt)
                req.sampling_params.max_tokens = 12
                req.sampling_params.temperature = 0.0
                req.sampling_params.ignore_eos = True
                tokens = []
                async for resp in stub.Generate(req):
                    tokens.extend(resp.token_ids)
                stats = await stub.GetStats(scheduler_pb2.GetStatsRequest())
                return tokens, stats

        tokens, stats = asyncio.run(go())
        assert len(tokens) == 12
        assert HFReference(model_dir).compare(prompt, tokens).tie_divergences == 0
        assert stats.kv_address == "in-process" and stats.kv_cache.num_total_blocks == 64
        assert stats.kv_cache.num_used_blocks == 0
    finally:
        scheduler.stop()
        for w in workers:
            w.stop()
