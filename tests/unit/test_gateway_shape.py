"""The gateway's shape (issue 25): one scheduler is a replica set of one, whose requests go
through the same retry loop as a router's (`TextGenerator.scheduler_responses`), with what a single
scheduler always did: a call refused UNAVAILABLE before anything streamed is made again
after a back-off, a pipeline down behind a live scheduler is final, and a scheduler that
stays down fails the request with its own error. And no function of gateway/ is longer
than a screen and a half."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import grpc
import pytest
from support.scripted_call import ScriptedCall, script_scheduler

from gateway.core import TextGenerator
from gateway.generation import Finished, GenerationError, GenerationParams
from gateway.replicas import ReplicaSet, merge_stats
from services.grpc_utils import PIPELINE_DOWN, UNAVAILABLE_REASON_KEY
from services.pb import common_pb2, scheduler_pb2
from services.sampling import SamplingOptions
from services.text import Tokenizer

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
MAX_FUNCTION_LINES = 80


def unavailable(details: str = "connection refused", reason: str | None = None) -> grpc.aio.AioRpcError:
    trailer = grpc.aio.Metadata(*([(UNAVAILABLE_REASON_KEY, reason)] if reason else []))
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), trailer, details=details)


class _Scheduler:
    """A scripted stub: the k-th `Generate` call plays `calls[k]` (the last one again after
    the script ends); `Abort` requests are recorded."""

    def __init__(self, *calls: tuple[list, Exception | None]) -> None:
        self.calls = calls
        self.num_calls = 0
        self.called_at: list[float] = []
        self.aborted: list[str] = []

    def Generate(self, request, metadata=None):  # noqa: N802 (gRPC's spelling)
        responses, error = self.calls[min(self.num_calls, len(self.calls) - 1)]
        self.num_calls += 1
        self.called_at.append(time.monotonic())
        return ScriptedCall(responses, error)

    async def Abort(self, request, timeout=None):  # noqa: N802
        self.aborted.append(request.request_id)
        return scheduler_pb2.AbortResponse()

    async def GetStats(self, request, timeout=None):  # noqa: N802
        return scheduler_pb2.GetStatsResponse(num_waiting=3)


def _last(request_id: str = "r") -> scheduler_pb2.GenerateResponse:
    resp = scheduler_pb2.GenerateResponse(request_id=request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH)
    resp.usage.num_prompt_tokens = 2
    return resp


@pytest.fixture(scope="module")
def tok(model_factory) -> Tokenizer:
    return Tokenizer(model_factory(arch="llama"))


def _generator(tok, scheduler: _Scheduler, retry_unavailable_s: float = 5.0) -> TextGenerator:
    generator = TextGenerator("127.0.0.1:1", tok, 64, retry_unavailable_s=retry_unavailable_s)
    script_scheduler(generator, scheduler)
    return generator


def _run(generator: TextGenerator) -> list:
    params = GenerationParams(sampling=SamplingOptions(max_tokens=1))

    async def go():
        return [item async for item in generator.generate([1, 2], params, "r")]

    return asyncio.run(asyncio.wait_for(go(), 30))


def test_one_scheduler_is_a_replica_set_of_one_that_routes_nothing():
    generator = TextGenerator("127.0.0.1:1", None, 64)
    assert generator.replicas is None and generator.scheduler_address == "127.0.0.1:1"
    named = TextGenerator("only=127.0.0.1:1", None, 64)
    assert named.replicas is None and named.scheduler_address == "127.0.0.1:1"
    several = TextGenerator("a=127.0.0.1:1,b=127.0.0.1:2", None, 64)
    assert several.replicas is not None and several.scheduler_address == "a=127.0.0.1:1,b=127.0.0.1:2"

    async def started() -> bool:  # a set of one is not polled
        generator.start()
        polling = generator._replicas._task is not None
        await generator.close()
        return polling

    assert not asyncio.run(started())


def test_a_set_of_one_picks_its_member_until_the_request_tried_it():
    rs = ReplicaSet([("r0", "127.0.0.1:1")], redis_url="redis://127.0.0.1:1")
    assert not rs.routes and rs.index is None  # no prefix index to read for one
    rs.mark_down(rs.replicas[0], "UNAVAILABLE: gone")  # down or not, it is the one choice
    replica, choice = asyncio.run(rs.pick([1, 2, 3]))
    assert replica is rs.replicas[0] and choice.name == "r0"
    from gateway.routing import NoReplica

    with pytest.raises(NoReplica, match="left to try"):
        asyncio.run(rs.pick([1, 2, 3], exclude=frozenset({"r0"})))


def test_a_lone_scheduler_unavailable_before_streaming_is_called_again_after_a_back_off(tok):
    scheduler = _Scheduler(([], unavailable()), ([_last()], None))
    items = _run(_generator(tok, scheduler))
    assert isinstance(items[-1], Finished) and items[-1].usage.prompt_tokens == 2
    assert scheduler.num_calls == 2
    assert scheduler.called_at[1] - scheduler.called_at[0] >= 0.2  # the first back-off


def test_a_lone_scheduler_that_stays_down_fails_with_its_own_error_once_the_wait_is_over(tok):
    scheduler = _Scheduler(([], unavailable("connection refused")))
    with pytest.raises(GenerationError) as caught:
        _run(_generator(tok, scheduler, retry_unavailable_s=0.5))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert caught.value.message == "connection refused"
    assert scheduler.num_calls == 2  # at 0 s, and after 0.2 s; the next wait (0.4 s) would end past 0.5 s


def test_a_pipeline_down_behind_a_lone_live_scheduler_is_final_at_once(tok):
    scheduler = _Scheduler(([], unavailable("pipeline unavailable: stage 0 down", PIPELINE_DOWN)))
    with pytest.raises(GenerationError, match="pipeline unavailable"):
        _run(_generator(tok, scheduler))
    assert scheduler.num_calls == 1


def test_the_retry_follows_the_trailer_not_the_message_words(tok):
    """A lone scheduler's UNAVAILABLE is retried unless its trailer says the pipeline is down,
    whatever its message says."""
    worded = _Scheduler(([], unavailable("pipeline unavailable (only the words)")))
    with pytest.raises(GenerationError):
        _run(_generator(tok, worded, retry_unavailable_s=0.5))
    assert worded.num_calls == 2  # retried: no trailer
    typed = _Scheduler(([], unavailable("stage 1 lost", PIPELINE_DOWN)))
    with pytest.raises(GenerationError, match="stage 1 lost"):
        _run(_generator(tok, typed))
    assert typed.num_calls == 1


@pytest.mark.parametrize(
    "streamed, code", [(True, grpc.StatusCode.UNAVAILABLE), (False, grpc.StatusCode.RESOURCE_EXHAUSTED)]
)
def test_a_failure_after_a_response_or_of_another_kind_is_final(tok, streamed, code):
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no")
    first = scheduler_pb2.GenerateResponse(request_id="r")
    scheduler = _Scheduler(([first] if streamed else [], error))
    with pytest.raises(GenerationError) as caught:
        _run(_generator(tok, scheduler))
    assert caught.value.code == code and scheduler.num_calls == 1


def test_an_abort_reaches_a_lone_scheduler_whether_or_not_the_request_runs_there():
    scheduler = _Scheduler(([], None))
    generator = TextGenerator("127.0.0.1:1", None, 64)
    script_scheduler(generator, scheduler)
    asyncio.run(generator.abort("ended"))
    assert scheduler.aborted == ["ended"]
    router = TextGenerator("a=127.0.0.1:1,b=127.0.0.1:2", None, 64)
    for r in router.replicas.replicas:
        r.stub = scheduler
    asyncio.run(router.abort("nowhere"))  # a router sends it where the request runs: nowhere
    assert scheduler.aborted == ["ended"]


def test_a_lone_schedulers_statistics_are_its_own_reply():
    generator = TextGenerator("127.0.0.1:1", None, 64)
    script_scheduler(generator, _Scheduler(([], None)))
    assert asyncio.run(generator.stats()).num_waiting == 3
    reply = scheduler_pb2.GetStatsResponse(num_waiting=1)
    assert merge_stats([reply]) is reply


def test_no_gateway_function_is_longer_than_a_screen_and_a_half():
    long = []
    for path in sorted(GATEWAY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{start} {node.name} ({node.end_lineno - start + 1} lines)")
    assert not long
