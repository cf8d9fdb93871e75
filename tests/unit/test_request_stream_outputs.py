"""`RequestStream`'s outputs (scheduler_svc/request_stream.py): the engine puts each admitted
request's outputs into the stream's outbox itself. What one output does there is checked
here without a scheduler: responses in order, the end closing the request's entry, an error
as its failure, and a response that cannot be built failing that request alone (the engine's
loop, which called, goes on)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from scheduler_svc.request_stream import RequestStream, _Outputs
from services.pb import scheduler_pb2


class FakeService:
    def __init__(self, broken: bool = False) -> None:
        self.broken = broken
        self.aborted: list[str] = []
        self.engine = SimpleNamespace(abort=self.aborted.append)

    def failure(self, request_id, error):
        return scheduler_pb2.RequestFailure(request_id=request_id, message=error[1])

    def responses(self, req, out):
        if self.broken:
            raise ValueError("no such token")
        return [scheduler_pb2.GenerateResponse(request_id=req.request_id, token_ids=out.tokens)]


def output(tokens, finished=False, error=None):
    return SimpleNamespace(tokens=tokens, finished=finished, error=error)


def admitted(service) -> tuple[RequestStream, _Outputs]:
    stream = RequestStream(service)
    outputs = _Outputs(stream, "r1")
    outputs.req = SimpleNamespace(request_id="r1", state=SimpleNamespace(is_live=True))
    stream._outputs["r1"] = outputs
    return stream, outputs


def drained(stream: RequestStream) -> list:
    items = []
    while not stream._outbox.empty():
        items.append(stream._outbox.get_nowait())
    return items


def test_outputs_go_out_in_order_and_the_last_closes_the_entry():
    async def go():
        stream, outputs = admitted(FakeService())
        outputs.put_nowait(output([1, 2]))
        outputs.put_nowait(output([3], finished=True))
        outputs.put_nowait(output([4]))  # (after the end: nothing)
        return stream, drained(stream)

    stream, items = asyncio.run(go())
    assert [list(m.token_ids) for m in items] == [[1, 2], [3]]
    assert stream._outputs == {}


def test_an_error_is_the_requests_failure():
    async def go():
        stream, outputs = admitted(FakeService())
        outputs.put_nowait(output([], error=("UNAVAILABLE", "pipeline down")))
        return stream, drained(stream)

    stream, items = asyncio.run(go())
    assert [type(m).__name__ for m in items] == ["RequestFailure"] and items[0].message == "pipeline down"
    assert stream._outputs == {}


def test_a_response_that_cannot_be_built_fails_its_request_and_aborts_it():
    async def go():
        service = FakeService(broken=True)
        stream, outputs = admitted(service)
        outputs.put_nowait(output([1]))  # must not raise into the engine
        return service, stream, drained(stream)

    service, stream, items = asyncio.run(go())
    assert len(items) == 1 and "ValueError: no such token" in items[0].message
    assert service.aborted == ["r1"] and stream._outputs == {}


def test_an_abort_sends_nothing_more_and_aborts_a_live_request_once():
    async def go():
        service = FakeService()
        stream, outputs = admitted(service)
        outputs.abort()
        outputs.abort()
        outputs.put_nowait(output([1]))  # the engine's final output of the aborted request
        return service, drained(stream)

    service, items = asyncio.run(go())
    assert service.aborted == ["r1"] and items == []


def test_an_abort_command_reaches_a_request_admitted_just_now():
    """Its admission task is done but its entry not yet dropped (a done callback runs a loop
    turn later): the abort still ends the request, not the finished task."""

    async def go():
        service = FakeService()
        stream, outputs = admitted(service)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        stream._pumps["r1"] = done
        stream._abort(scheduler_pb2.AbortRequest(request_id="r1"))
        outputs.put_nowait(output([1]))
        return service, drained(stream)

    service, items = asyncio.run(go())
    assert service.aborted == ["r1"] and items == []
