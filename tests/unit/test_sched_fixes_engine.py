"""Events queued while the engine recovers: those of the connection that recovery replaced
are dropped, those of the new connection count (a stage that dies right after recovery is
noticed). Driven with a scripted transport and KV client, no model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.events import StageDownEvent, StageInfo

CONFIG = SchedulerConfig(block_size=16, num_kv_blocks=64, scheduler_timeout_ms=10)

OnEvent = Callable[[object], None]


class IdleKV:
    """A KV service with nothing to do: no request is ever submitted in these tests."""

    def __init__(self) -> None:
        self.num_resets = 0

    async def step(self, step_input):
        raise AssertionError("nothing should be planned")

    async def reset(self) -> None:
        self.num_resets += 1

    async def stats(self):
        return None


class ScriptedTransport:
    """One stage that connects at once. `during_connect[k]` runs inside the k-th connect
    (1-based) with the event callbacks of every attempt so far; it may raise to fail it."""

    def __init__(self, during_connect: dict[int, Callable[[list[OnEvent]], None]]) -> None:
        self.during_connect = during_connect
        self.callbacks: list[OnEvent] = []

    async def connect(self, on_event: OnEvent, timeout_s: float) -> list[StageInfo]:
        self.callbacks.append(on_event)
        hook = self.during_connect.get(len(self.callbacks))
        if hook is not None:
            hook(self.callbacks)
        return [
            StageInfo(
                stage_index=0,
                num_stages=1,
                epoch=len(self.callbacks),
                layer_start=0,
                layer_end=2,
                num_layers=2,
                num_kv_blocks=64,
                block_size=16,
                vocab_size=32,
            )
        ]

    async def submit(self, mb) -> None:
        raise AssertionError("nothing should be dispatched")

    async def stage_stats(self, timeout_s: float = 1.0) -> list[dict]:
        return []

    async def close(self) -> None:
        pass


async def settle(engine: Engine, transport: ScriptedTransport, num_connects: int, timeout_s: float = 3.0) -> None:
    """Wait for `num_connects` connects and a healthy engine (or the timeout), then a little more
    so that an extra, unexpected reconnect would show."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline and not (len(transport.callbacks) >= num_connects and engine.healthy):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)


def test_a_stage_down_of_the_new_connection_during_recovery_is_handled():
    def second_connect(callbacks: list[OnEvent]) -> None:
        callbacks[0](StageDownEvent(0, "the old event stream ended"))  # late, from the replaced connection
        callbacks[1](StageDownEvent(0, "stage 0 died right after it was ready"))  # the new connection's

    async def scenario() -> tuple[Engine, ScriptedTransport, IdleKV]:
        transport, kv = ScriptedTransport({2: second_connect}), IdleKV()
        engine = Engine(CONFIG, kv, transport)
        await engine.start()
        try:
            transport.callbacks[0](StageDownEvent(0, "stage 0 died"))
            await settle(engine, transport, num_connects=3)
        finally:
            await engine.stop()
        return engine, transport, kv

    engine, transport, kv = asyncio.run(scenario())
    # the new connection's stage-down made the engine recover once more; the old one's did not
    assert len(transport.callbacks) == 3
    # resets: one at start (a new scheduler releases what a previous one held), one per recovery
    assert engine.num_recoveries == 2 and kv.num_resets == 1 + 2
    assert engine.healthy and engine.health_detail == "serving"


def test_events_of_replaced_connections_and_failed_attempts_are_dropped():
    def second_connect(callbacks: list[OnEvent]) -> None:
        callbacks[1](StageDownEvent(0, "went down while connecting"))
        raise ConnectionError("stages not ready")  # this attempt fails: its events are stale

    def third_connect(callbacks: list[OnEvent]) -> None:
        callbacks[0](StageDownEvent(0, "the old event stream ended"))

    async def scenario() -> tuple[Engine, ScriptedTransport, IdleKV]:
        transport, kv = ScriptedTransport({2: second_connect, 3: third_connect}), IdleKV()
        engine = Engine(CONFIG, kv, transport)
        await engine.start()
        try:
            transport.callbacks[0](StageDownEvent(0, "stage 0 died"))
            await settle(engine, transport, num_connects=3)
            # an event of a replaced connection that comes later still is ignored as well
            for stale in transport.callbacks[:2]:
                stale(StageDownEvent(0, "late"))
            await settle(engine, transport, num_connects=3)
        finally:
            await engine.stop()
        return engine, transport, kv

    engine, transport, kv = asyncio.run(scenario())
    assert len(transport.callbacks) == 3
    # resets: one at start, then one per recovery attempt (the failed one and the good one)
    assert engine.num_recoveries == 1 and kv.num_resets == 1 + 2
    assert engine.healthy and engine.health_detail == "serving"


def test_outputs_a_consumer_missed_come_as_one():
    """A slow consumer (the gateway) gets the steps it missed merged, tokens in order per
    choice, the finish and the request's totals from the last."""
    from scheduler_svc.core.request import FinishReason
    from scheduler_svc.outputs import ChoiceDelta, RequestOutput, merge_outputs

    first = RequestOutput("r", [ChoiceDelta(0, [5], [None]), ChoiceDelta(1, [7], [None])])
    second = RequestOutput("r", [ChoiceDelta(1, [8], [None])], prompt_logprobs=[(5, -1.0, 1, [])])
    last = RequestOutput(
        "r",
        [ChoiceDelta(0, [6], [None], FinishReason.STOP, 6)],
        finished=True,
        num_prompt_tokens=3,
        num_completion_tokens=4,
    )
    out = merge_outputs(merge_outputs(first, second), last)
    assert [(d.index, d.token_ids, d.finish_reason, d.stop_token_id) for d in out.deltas] == [
        (0, [5, 6], FinishReason.STOP, 6),
        (1, [7, 8], None, None),
    ]
    assert out.finished and (out.num_prompt_tokens, out.num_completion_tokens) == (3, 4)
    assert out.prompt_logprobs == [(5, -1.0, 1, [])]
    assert len(out.deltas[0].logprobs) == 2


def test_an_error_is_not_merged_into_the_tokens_before_it():
    """Found in review: merging tokens with a final error made the server drop the tokens."""
    from scheduler_svc.core.request import Request, SamplingOptions
    from scheduler_svc.outputs import ChoiceDelta, LiveRequest, RequestOutput, stream_outputs

    async def go():
        live = LiveRequest(Request("r", (1,), SamplingOptions(), 0.0), asyncio.Queue())
        live.outputs.put_nowait(RequestOutput("r", [ChoiceDelta(0, [11], [None])]))
        live.outputs.put_nowait(RequestOutput("r", [ChoiceDelta(0, [12], [None])]))
        live.outputs.put_nowait(RequestOutput("r", [], finished=True, error=("INTERNAL", "boom")))
        return [out async for out in stream_outputs(live, lambda request_id: False)]

    outs = asyncio.run(go())
    assert [(o.deltas[0].token_ids if o.deltas else [], o.error) for o in outs] == [
        ([11, 12], None),
        ([], ("INTERNAL", "boom")),
    ]
