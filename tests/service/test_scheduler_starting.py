"""A scheduler still connecting to its stages (found by the gRPC fuzzer, issue 16): its health
is NOT_SERVING, and a Generate call then is UNAVAILABLE (the gateway retries it) instead of
being queued before the vocabulary is known and failing INTERNAL at a stage."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from services.grpc_utils import INTERNAL_TOKEN_HEADER, check_health, internal_token
from services.pb import scheduler_pb2
from wiring.launcher import ServiceProcess, free_port, pagoda_command


def test_a_starting_scheduler_is_not_serving_and_refuses_unavailable(model_factory, tmp_path):
    port = free_port()
    absent_stage = f"127.0.0.1:{free_port()}"  # nothing listens there: the scheduler keeps waiting
    scheduler = ServiceProcess("scheduler", pagoda_command(
        "scheduler", "--model", model_factory(arch="llama"), "--port", str(port), "--kvcache", "in-process",
        "--stages", absent_stage), f"127.0.0.1:{port}", log_path=tmp_path / "scheduler.log")
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
                list(call(request.SerializeToString(), timeout=10,
                          metadata=((INTERNAL_TOKEN_HEADER, token),) if token else None))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "starting" in err.value.details()
    finally:
        scheduler.stop()
