"""The step's streams on a stage's local socket (services/local_stream.py): the same messages
as the gRPC streams, framed on an abstract Unix socket, with gRPC's errors."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from services import local_stream
from services.local_stream import LocalListener, LocalStreamError, open_call
from services.pb import common_pb2, worker_pb2


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


class Stage:
    """A listener whose Forward keeps what comes, whose Events echo what they are fed, and
    whose Feedback refuses a step, as the stage's handlers do."""

    def __init__(self, max_message_bytes: int = 1 << 20) -> None:
        self.received: list[worker_pb2.MicroBatch] = []
        self.events: asyncio.Queue = asyncio.Queue()
        self.forward_ended = asyncio.Event()
        self.listener = LocalListener(
            {"Forward": self.forward, "Events": self.watch, "Feedback": self.feedback}, max_message_bytes
        )

    async def forward(self, stream) -> None:
        async for mb in stream.messages(worker_pb2.MicroBatch):
            self.received.append(mb)
        self.forward_ended.set()

    async def watch(self, stream) -> None:
        async def events(request, context):
            yield worker_pb2.StageEvent(stage_index=7, epoch=len(request.subscriber))
            while True:
                yield await self.events.get()

        await stream.respond(worker_pb2.EventsRequest, events)

    async def feedback(self, stream) -> None:
        async for fb in stream.messages(worker_pb2.SampledFeedback):
            if fb.micro_batch_id == 13:
                await stream.context.abort(grpc.StatusCode.INVALID_ARGUMENT, "step 13: columns of unequal length")

    def call(self, method: str, **kwargs):
        return open_call(self.listener.address, self.listener.token, method, **kwargs)


def test_messages_arrive_whole_and_in_order_and_a_clean_end_is_no_error():
    async def go():
        stage = Stage()
        await stage.listener.start()
        call = await stage.call("Forward")
        sent = [worker_pb2.MicroBatch(micro_batch_id=i, stage_index=1, sent_ns=i * 10) for i in range(1, 200)]
        sent.append(worker_pb2.MicroBatch(micro_batch_id=999))  # an empty-ish message
        for mb in sent:
            await call.write(mb)
        await call.done_writing()
        await call  # the stage's handler returned: OK
        assert stage.received == sent
        assert stage.listener.num_open == 0
        await stage.listener.close()

    run(go())


def test_a_server_stream_comes_back_and_ends_when_the_dialer_goes():
    async def go():
        stage = Stage()
        await stage.listener.start()
        request = worker_pb2.EventsRequest(subscriber="scheduler")
        call = await stage.call("Events", request=request, response_type=worker_pb2.StageEvent)
        got = []
        for i in range(3):
            await stage.events.put(worker_pb2.StageEvent(stage_index=i))
        async for event in call:
            got.append(event)
            if len(got) == 4:
                break
        assert [e.stage_index for e in got] == [7, 0, 1, 2] and got[0].epoch == len("scheduler")
        assert stage.listener.num_open == 1
        call.cancel()
        for _ in range(100):  # the stage notices the dialer went and stops its responses
            if stage.listener.num_open == 0:
                break
            await asyncio.sleep(0.01)
        assert stage.listener.num_open == 0
        await stage.listener.close()

    run(go())


def test_an_abort_reads_as_its_grpc_status():
    async def go():
        stage = Stage()
        await stage.listener.start()
        call = await stage.call("Feedback")
        await call.write(worker_pb2.SampledFeedback(micro_batch_id=12))
        await call.write(worker_pb2.SampledFeedback(micro_batch_id=13))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "step 13" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError):  # a write after the end fails too
            await call.write(worker_pb2.SampledFeedback(micro_batch_id=14))
        await stage.listener.close()

    run(go())


def test_a_wrong_token_or_method_is_refused_and_a_missing_socket_is_unavailable():
    async def go():
        stage = Stage()
        await stage.listener.start()
        with pytest.raises(LocalStreamError) as err:
            await open_call(stage.listener.address, bytes(16), "Forward")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(LocalStreamError) as err:
            await stage.call("Shutdown")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stage.listener.num_refused == 2
        await stage.listener.close()
        with pytest.raises(LocalStreamError) as err:
            await stage.call("Forward")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(LocalStreamError):
            await open_call("127.0.0.1:1", bytes(16), "Forward")  # not a local socket's name

    run(go())


def test_an_oversized_or_undecodable_message_ends_the_stream_and_the_listener_serves_on():
    async def go():
        stage = Stage(max_message_bytes=1000)
        await stage.listener.start()
        call = await stage.call("Forward")
        await call.write(worker_pb2.MicroBatch(micro_batch_id=1))
        await call.write(worker_pb2.MicroBatch(micro_batch_id=2, hidden_states=common_pb2.Tensor(data=bytes(5000))))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [mb.micro_batch_id for mb in stage.received] == [1]
        # garbage in a frame: the raw socket, past the hello
        reader, writer = await asyncio.open_unix_connection("\0" + stage.listener.address[1:])
        writer.write(local_stream._frame(0, stage.listener.token + b"Forward"))
        assert (await local_stream._read_frame(reader, 100))[0] == 0  # accepted
        writer.write(local_stream._frame(0, b"\xff\xff\xff"))
        kind, body = await local_stream._read_frame(reader, 4096)
        assert kind == 1 and local_stream._status(body[0]) == grpc.StatusCode.INVALID_ARGUMENT
        writer.close()
        again = await stage.call("Forward")  # the listener is unharmed
        await again.write(worker_pb2.MicroBatch(micro_batch_id=3))
        await again.done_writing()
        await again
        assert [mb.micro_batch_id for mb in stage.received] == [1, 3]
        await stage.listener.close()

    run(go())


def test_a_peer_that_goes_is_unavailable_to_the_dialer():
    async def go():
        stage = Stage()
        await stage.listener.start()
        call = await stage.call("Events", request=worker_pb2.EventsRequest(), response_type=worker_pb2.StageEvent)
        first = await anext(aiter(call))
        assert first.stage_index == 7
        await stage.listener.close()  # as the stage's process ends: its open streams are cut
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    run(go())


def test_the_socket_is_abstract_and_leaves_no_file():
    async def go():
        stage = Stage()
        await stage.listener.start()
        assert stage.listener.address.startswith("@pagoda-")
        with socket.socket(socket.AF_UNIX) as s:  # reachable by its name on this host
            s.connect("\0" + stage.listener.address[1:])
        await stage.listener.close()

    run(go())


def test_a_threads_own_writes_arrive_in_order_with_the_loops():
    """`send_now` from another thread, interleaved with the event loop's writes under
    `DirectWrites`: every message arrives once, in the order written."""

    async def go():
        stage = Stage()
        await stage.listener.start()
        call = await stage.call("Forward")
        turns = local_stream.DirectWrites()
        loop = asyncio.get_running_loop()

        def thread_writes() -> None:
            for i in range(1, 201):
                mb = worker_pb2.MicroBatch(micro_batch_id=i)
                if i % 7 and turns.take(call):
                    call.send_now(mb)
                else:  # (every 7th, and whenever the loop holds one: the loop writes it)
                    asyncio.run_coroutine_threadsafe(loop_write(mb), loop).result()

        async def loop_write(mb) -> None:
            await call.write(mb)
            if mb.micro_batch_id % 7:
                turns.written()

        await asyncio.to_thread(thread_writes)
        assert not turns.take(object())  # not a local stream: the loop's (one more pending)
        assert not turns.take(call)  # ... so the loop holds one: the thread waits its turn
        await call.done_writing()
        await call
        assert [mb.micro_batch_id for mb in stage.received] == list(range(1, 201))
        await stage.listener.close()

    run(go())
