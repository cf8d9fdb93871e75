"""A test driver (not the scheduler) for a chain of real stage-worker processes.

It holds an `Events` stream from every stage and one `Forward` stream into stage 0, keeps
up to `max_in_flight` micro-batches in the pipeline (never a sequence in two), and applies
the last stage's sampled tokens as they come back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from services.grpc_utils import aio_channel
from services.pb import worker_pb2, worker_pb2_grpc
from services.step_codec import plan_to_pb, result_from_pb
from support.driver import Chunks, DriverSeq, PlanBuilder


class StageFailure(Exception):
    def __init__(self, stage: int, micro_batch_id: int | None, code: int | str, message: str):
        super().__init__(f"stage {stage}, micro-batch {micro_batch_id}: {code} {message}")
        self.stage, self.micro_batch_id, self.code, self.message = stage, micro_batch_id, code, message


@dataclass
class StageView:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.StageWorkerStub
    load_info: worker_pb2.StageLoadInfo | None = None
    events: list[worker_pb2.StageEvent] = field(default_factory=list)


class GrpcPipelineDriver:
    def __init__(self, addresses: list[str], builder: PlanBuilder, max_in_flight: int = 2) -> None:
        self.addresses = addresses
        self.builder = builder
        self.max_in_flight = max_in_flight
        self.stages: list[StageView] = []
        self._results: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._forward = None
        self.failures: list[StageFailure] = []
        self.stream_errors: list[tuple[int, float, grpc.StatusCode]] = []  # stage, time, code
        self.peak_in_flight = 0

    async def connect(self) -> None:
        for i, address in enumerate(self.addresses):
            channel = aio_channel(address)
            view = StageView(address, channel, worker_pb2_grpc.StageWorkerStub(channel))
            self.stages.append(view)
            ready = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._read_events(i, view, ready)))
            await asyncio.wait_for(ready.wait(), timeout=30)
        self._forward = self.stages[0].stub.Forward()
        self._tasks.append(asyncio.create_task(self._watch_forward(self._forward)))

    async def close(self) -> None:
        if self._forward is not None:
            self._forward.cancel()
        for task in self._tasks:
            task.cancel()
        for view in self.stages:
            await view.channel.close()

    async def _read_events(self, index: int, view: StageView, ready: asyncio.Event) -> None:
        try:
            async for event in view.stub.Events(worker_pb2.EventsRequest(subscriber="test-driver")):
                view.events.append(event)
                if event.HasField("ready"):
                    view.load_info = event.ready
                    ready.set()
                    continue
                done = event.done
                if done.HasField("error"):
                    await self._results.put(
                        StageFailure(index, done.micro_batch_id, done.error.code, done.error.message)
                    )
                elif index == len(self.addresses) - 1:
                    await self._results.put(done)
        except grpc.aio.AioRpcError as exc:
            self.stream_errors.append((index, time.monotonic(), exc.code()))
            await self._results.put(StageFailure(index, None, exc.code().name, exc.details() or ""))

    async def _watch_forward(self, call) -> None:  # (it answers only when the stream ends)
        try:
            await call
        except grpc.aio.AioRpcError:
            pass

    async def send(self, mb: worker_pb2.MicroBatch) -> None:
        await self._forward.write(mb)

    async def next_result(self, timeout_s: float = 60.0):
        return await asyncio.wait_for(self._results.get(), timeout=timeout_s)

    async def run(self, seqs: list[DriverSeq] | None = None, timeout_s: float = 120.0, until=None) -> list[list[int]]:
        """Drive until every sequence is done (or `until()` holds with nothing in flight).

        Raises StageFailure on any stage's error.
        """
        for s in seqs or []:
            self.builder.add(s)
        in_flight: dict[int, Chunks] = {}
        deadline = time.monotonic() + timeout_s
        while not self.builder.all_done:
            if until is not None and not in_flight and until():
                break
            busy = {s.seq_id for chunks in in_flight.values() for s, _ in chunks}
            while len(in_flight) < self.max_in_flight:
                formed = self.builder.form_plan(busy)
                if formed is None:
                    break
                plan, chunks = formed
                in_flight[plan.step_id] = chunks
                busy |= {s.seq_id for s, _ in chunks}
                await self.send(plan_to_pb(plan))
            self.peak_in_flight = max(self.peak_in_flight, len(in_flight))
            if not in_flight:  # nothing to wait for and nothing to send: it would spin for ever
                raise AssertionError("no step in flight and none can be formed, yet sequences are not done")
            result = await self.next_result(max(0.1, deadline - time.monotonic()))
            if isinstance(result, StageFailure):
                self.failures.append(result)
                raise result
            chunks = in_flight.pop(result.micro_batch_id)
            sampled = result_from_pb(result).sampled  # (rows or columns, as the stage sent them)
            self.builder.complete(chunks, [t.seq_id for t in sampled], [t.token_id for t in sampled])
        return [s.outputs for s in (seqs or self.builder.seqs)]
