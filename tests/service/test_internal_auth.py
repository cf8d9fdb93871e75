"""Service-to-service authentication (issue 16, defect 9): with the stack's secret set
(`PAGODA_INTERNAL_TOKEN`; the tests' conftest sets one, `pagoda serve` makes one per run),
an internal service refuses a caller without it (UNAUTHENTICATED, before anything changes),
health probes excepted; the stack's own channels carry it. A real `pagoda kvcache` process
and a real `pagoda serve` stack."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.grpc_utils import INTERNAL_TOKEN_HEADER, aio_channel, internal_token
from services.pb import kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from wiring.launcher import ServiceProcess, free_port, pagoda_command


@pytest.fixture(scope="module")
def kvcache(tmp_path_factory):
    assert internal_token(), "tests/conftest.py sets the stack's secret"
    port = free_port()
    address = f"127.0.0.1:{port}"
    service = ServiceProcess(
        "kvcache",
        pagoda_command("kvcache", "--port", str(port), "--num-blocks", "64", "--block-size", "4"),
        address,
        log_path=tmp_path_factory.mktemp("auth-logs") / "kvcache.log",
    )
    service.start()
    try:
        service.wait_healthy(60)  # the health probe carries no secret: probes stay open
        yield address
    finally:
        service.stop()


def _new(seq_id: int) -> kvcache_pb2.StepRequest:
    return kvcache_pb2.StepRequest(
        micro_batch_id=seq_id, new_sequences=[kvcache_pb2.NewSequence(seq_id=seq_id, token_ids=range(32))]
    )


async def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details()


def test_a_caller_without_the_secret_changes_nothing(kvcache):
    async def scenario():
        async with grpc.aio.insecure_channel(kvcache) as bare:
            stub = kvcache_pb2_grpc.KVCacheStub(bare)
            no_token = await _refused(stub.Step(_new(1)))
            wrong = await _refused(stub.Step(_new(2), metadata=[(INTERNAL_TOKEN_HEADER, "guess")]))
            stats_refused = await _refused(stub.Stats(kvcache_pb2.KVStatsRequest()))
            health = await health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest())
        async with aio_channel(kvcache) as channel:  # the stack's own channel: it carries the secret
            stats = await kvcache_pb2_grpc.KVCacheStub(channel).Stats(kvcache_pb2.KVStatsRequest())
        return no_token, wrong, stats_refused, health, stats

    no_token, wrong, stats_refused, health, stats = asyncio.run(scenario())
    for code, details in (no_token, wrong, stats_refused):
        assert code == grpc.StatusCode.UNAUTHENTICATED and INTERNAL_TOKEN_HEADER in details
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert stats.num_used_blocks == 0 and stats.num_sequences == 0  # nothing was allocated


def test_the_stack_works_with_its_secret_and_refuses_direct_calls_without_it(model_factory, tmp_path):
    """`pagoda serve`: a completion goes through (every internal hop carries the secret);
    the scheduler refuses a direct Generate without it."""
    import openai

    port, grpc_port = free_port(), free_port()
    ready = tmp_path / "ready.json"
    serve = ServiceProcess(
        "serve",
        pagoda_command(
            "serve",
            model_factory(arch="llama"),
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--pipeline-parallel-size",
            "2",
            "--num-kv-blocks",
            "64",
            "--num-threads",
            "1",
            "--max-model-len",
            "256",
            "--served-model-name",
            "tiny",
            "--log-dir",
            str(tmp_path),
            "--ready-file",
            str(ready),
        ),
        f"127.0.0.1:{grpc_port}",
        log_path=tmp_path / "serve.log",
    )
    serve.start()
    try:
        serve.wait_healthy(180)
        for _ in range(100):
            if ready.exists():
                break
            time.sleep(0.1)
        scheduler = json.loads(ready.read_text())["scheduler"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=4).choices[0].text is not None

        async def direct():
            async with grpc.aio.insecure_channel(scheduler) as bare:
                request = scheduler_pb2.GenerateRequest(request_id="intruder", prompt_token_ids=[1, 2, 3])
                request.sampling_params.max_tokens = 4
                call = scheduler_pb2_grpc.SchedulerStub(bare).Generate(request)
                return await _refused(_drain(call))

        code, _ = asyncio.run(direct())
        assert code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        serve.stop(30)


async def _drain(call):
    async for _ in call:
        pass
