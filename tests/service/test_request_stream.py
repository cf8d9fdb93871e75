"""`Scheduler.GenerateStream` (issue 37): many requests on the gateway's one stream to a
scheduler, through real processes (a KV service, a stage worker, a scheduler). Each request
gets what its own `Generate` call would: the same tokens, its failures as the call's status
(field named), an abort that ends it and frees its blocks; a scheduler that dies fails every
request on the stream UNAVAILABLE, and the next request opens a new stream. Each on both
channels: the scheduler's local socket (this host: the default) and gRPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from support.stack import kill_stack, kill_tree

from gateway.scheduler_stream import SchedulerStream
from services import local_stream
from services.grpc_utils import aio_channel
from services.pb import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from wiring.launcher import start_stack

MAX_TOKENS = 12
# the schedulers here offer their socket whatever the environment says (a run forcing gRPC
# everywhere, PAGODA_REQUEST_CHANNEL=grpc, still tests both channels of the stream)
LOCAL = ["--request-channel", "auto"]
CHANNELS = {"unix": {}, "grpc": {"max_message_bytes": None}}  # SchedulerStream's settings: local first, gRPC only
channels = pytest.mark.parametrize("channel", list(CHANNELS))


def open_stream(stub, channel: str) -> SchedulerStream:
    return SchedulerStream(stub, **CHANNELS[channel])


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    s = start_stack(
        model_dir,
        num_stages=1,
        num_kv_blocks=128,
        block_size=16,
        log_dir=tmp_path_factory.mktemp("rs"),
        threads_per_worker=1,
        scheduler_args=LOCAL,
    )
    yield s
    kill_stack(s)


def request(i: int, n: int = 30, max_tokens: int = MAX_TOKENS) -> scheduler_pb2.GenerateRequest:
    prompt = torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(i)).tolist()
    req = scheduler_pb2.GenerateRequest(request_id=f"req-{i}", prompt_token_ids=prompt)
    req.sampling_params.max_tokens = max_tokens
    req.sampling_params.temperature = 0.0
    req.sampling_params.ignore_eos = True
    return req


async def collect(call) -> list[int]:
    tokens = []
    async for resp in call:
        tokens.extend(resp.token_ids)
    return tokens


async def used_blocks(stub) -> int:
    for _ in range(100):
        used = (await stub.GetStats(scheduler_pb2.GetStatsRequest())).kv_cache.num_used_blocks
        if not used:
            return 0
        await asyncio.sleep(0.05)
    return used


@channels
def test_many_requests_on_one_stream_get_what_their_own_calls_get(stack, channel):
    async def go():
        async with aio_channel(stack.scheduler_address) as grpc_channel:
            stub = scheduler_pb2_grpc.SchedulerStub(grpc_channel)
            own = [await collect(stub.Generate(request(i))) for i in range(24)]
            stream = open_stream(stub, channel)
            shared = await asyncio.gather(*(collect(stream.generate(request(i))) for i in range(24)))
            opened = (stream.num_streams, stream.channel)
            await stream.close()
            return own, shared, opened, await used_blocks(stub)

    own, shared, opened, used = asyncio.run(go())
    assert shared == own and all(len(t) == MAX_TOKENS for t in own)
    assert opened == (1, channel) and used == 0


@channels
def test_a_bad_request_fails_alone_and_an_abort_ends_its_request(stack, channel):
    async def go():
        async with aio_channel(stack.scheduler_address) as grpc_channel:
            stub = scheduler_pb2_grpc.SchedulerStub(grpc_channel)
            stream = open_stream(stub, channel)
            bad = request(100)
            bad.sampling_params.top_p = 7.0
            long = stream.generate(request(101, max_tokens=400))
            good = asyncio.ensure_future(collect(stream.generate(request(102))))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await collect(stream.generate(bad))
            got = []
            async for resp in long:  # a few tokens, then the caller stops reading: aborted
                got.extend(resp.token_ids)
                if len(got) >= 3:
                    break
            tokens = await good
            used = await used_blocks(stub)
            await stream.close()
            return failed.value, tokens, used

    error, tokens, used = asyncio.run(go())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in error.details()
    assert len(tokens) == MAX_TOKENS
    assert used == 0  # the aborted request's blocks are back


@channels
def test_a_scheduler_that_dies_fails_its_streams_requests_unavailable(model_dir, tmp_path_factory, channel):
    s = start_stack(
        model_dir,
        num_stages=1,
        num_kv_blocks=64,
        block_size=16,
        log_dir=tmp_path_factory.mktemp("rs2"),
        threads_per_worker=1,
        scheduler_args=LOCAL,
    )
    try:

        async def go():
            async with aio_channel(s.scheduler_address) as grpc_channel:
                stream = open_stream(scheduler_pb2_grpc.SchedulerStub(grpc_channel), channel)
                calls = [stream.generate(request(200 + i, max_tokens=900)) for i in range(4)]
                firsts = [aiter(c) for c in calls]
                for it in firsts:
                    await anext(it)  # each has started streaming
                kill_tree(s.scheduler)
                codes = []
                for it in firsts:
                    try:
                        async for _ in it:
                            pass
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
                await stream.close()
                return codes, stream.channel

        codes, opened = asyncio.run(go())
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 4 and opened == channel
    finally:
        kill_stack(s)


@channels
def test_a_stream_that_ends_aborts_its_running_requests_and_a_live_id_is_refused(stack, channel):
    """The engine puts each admitted request's outputs into the stream itself (no task per
    request): the gateway's stream ending must still end every request on it, and a second
    request under a running one's id is refused on the stream, the first one unharmed."""

    async def go():
        async with aio_channel(stack.scheduler_address) as grpc_channel:
            stub = scheduler_pb2_grpc.SchedulerStub(grpc_channel)
            stream = open_stream(stub, channel)
            calls = [aiter(stream.generate(request(300 + i, max_tokens=400))) for i in range(3)]
            for it in calls:
                await anext(it)  # each is running
            with pytest.raises(grpc.aio.AioRpcError) as twice:
                await collect(stream.generate(request(300, max_tokens=4)))
            await anext(calls[0])  # the first one goes on
            running = (await stub.GetStats(scheduler_pb2.GetStatsRequest())).num_running
            await stream.close()
            for _ in range(100):
                stats = await stub.GetStats(scheduler_pb2.GetStatsRequest())
                if not stats.num_running and not stats.kv_cache.num_used_blocks:
                    break
                await asyncio.sleep(0.05)
            return twice.value, running, stats

    twice, running, stats = asyncio.run(go())
    assert twice.code() == grpc.StatusCode.INVALID_ARGUMENT and "already live" in twice.details()
    assert running == 3
    assert stats.num_running == 0 and stats.kv_cache.num_used_blocks == 0


def test_a_scheduler_set_to_grpc_offers_no_local_socket_and_its_stream_takes_grpc(model_dir, tmp_path_factory):
    """`--request-channel grpc`: LocalEndpoint answers empty, the stream opens as a gRPC call
    and serves the same tokens; a stream on a wrong token is refused, nothing served on it."""
    s = start_stack(
        model_dir,
        num_stages=1,
        num_kv_blocks=64,
        block_size=16,
        log_dir=tmp_path_factory.mktemp("rs3"),
        threads_per_worker=1,
        scheduler_args=["--request-channel", "grpc"],
    )
    try:

        async def go():
            async with aio_channel(s.scheduler_address) as grpc_channel:
                stub = scheduler_pb2_grpc.SchedulerStub(grpc_channel)
                offered = await stub.LocalEndpoint(common_pb2.LocalEndpointRequest())
                stream = SchedulerStream(stub)
                tokens = await collect(stream.generate(request(400)))
                opened = stream.channel
                await stream.close()
                return offered, tokens, opened

        offered, tokens, opened = asyncio.run(go())
        assert offered.local_socket == "" and offered.local_token == b""
        assert opened == "grpc" and len(tokens) == MAX_TOKENS
    finally:
        kill_stack(s)


def test_the_local_socket_refuses_a_wrong_token(stack):
    async def go():
        async with aio_channel(stack.scheduler_address) as grpc_channel:
            stub = scheduler_pb2_grpc.SchedulerStub(grpc_channel)
            offered = await stub.LocalEndpoint(common_pb2.LocalEndpointRequest())
            with pytest.raises(local_stream.LocalStreamError) as refused:
                await local_stream.open_call(offered.local_socket, bytes(16), "GenerateStream")
            return offered, refused.value

    offered, refused = asyncio.run(go())
    assert offered.local_socket.startswith("@") and len(offered.local_token) == 16
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
