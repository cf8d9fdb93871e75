"""A scheduler still connecting to its stages (found by the gRPC fuzzer, issue 16): its health
is NOT_SERVING, and a Generate call then is UNAVAILABLE (the gateway retries it) instead of
being queued before the vocabulary is known and failing INTERNAL at a stage."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
from support.workers import start_chain

from services.grpc_utils import (
    INTERNAL_TOKEN_HEADER,
    PIPELINE_DOWN,
    UNAVAILABLE_REASON_KEY,
    check_health,
    internal_token,
)
from services.pb import scheduler_pb2
from wiring.launcher import ServiceProcess, free_port, pagoda_command


def test_a_starting_scheduler_is_not_serving_and_refuses_unavailable(model_factory, tmp_path):
    port = free_port()
    absent_stage = f"127.0.0.1:{free_port()}"  # nothing listens there: the scheduler keeps waiting
    scheduler = ServiceProcess(
        "scheduler",
        pagoda_command(
            "scheduler",
            "--model",
            model_factory(arch="llama"),
            "--port",
            str(port),
            "--kvcache",
            "in-process",
            "--stages",
            absent_stage,
        ),
        f"127.0.0.1:{port}",
        log_path=tmp_path / "scheduler.log",
    )
    scheduler.start()
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        else:
            pytest.fail("the scheduler never listened")
        assert not check_health(f"127.0.0.1:{port}")
        request = scheduler_pb2.GenerateRequest(prompt_token_ids=[99999])
        request.sampling_params.max_tokens = 4
        token = internal_token()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/pagoda.v1.Scheduler/Generate")
            with pytest.raises(grpc.RpcError) as err:
                list(
                    call(
                        request.SerializeToString(),
                        timeout=10,
                        metadata=((INTERNAL_TOKEN_HEADER, token),) if token else None,
                    )
                )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "starting" in err.value.details()
    finally:
        scheduler.stop()


def _generate(port: int, prompt: list[int]) -> list:
    request = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt)
    request.sampling_params.max_tokens = 4
    token = internal_token()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/pagoda.v1.Scheduler/Generate")
        return list(
            call(request.SerializeToString(), timeout=30, metadata=((INTERNAL_TOKEN_HEADER, token),) if token else None)
        )


def test_a_pipeline_down_past_its_recovery_timeout_says_so_in_the_trailer(model_factory, tmp_path):
    """The gateway retries a lone scheduler's UNAVAILABLE unless the trailer says its pipeline
    stayed down (gateway/core.py `pipeline_down`): the scheduler, up, puts that reason there."""
    model = model_factory(arch="llama")
    (stage,) = start_chain(model, 1, tmp_path)
    port = free_port()
    scheduler = ServiceProcess(
        "scheduler",
        pagoda_command(
            "scheduler",
            "--model",
            model,
            "--port",
            str(port),
            "--kvcache",
            "in-process",
            "--num-kv-blocks",
            "256",
            "--stages",
            stage.health_address,
            "--recovery-timeout-s",
            "1",
        ),
        f"127.0.0.1:{port}",
        log_path=tmp_path / "scheduler.log",
    )
    scheduler.start()
    try:
        scheduler.wait_healthy(60)
        assert _generate(port, [5, 6, 7])  # served while the stage lives
        stage.kill()
        with pytest.raises(grpc.RpcError) as err:
            _generate(port, [5, 6, 8])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert dict(err.value.trailing_metadata() or ()).get(UNAVAILABLE_REASON_KEY) == PIPELINE_DOWN
    finally:
        scheduler.stop()
        stage.kill()
