"""Sampled-token feedback between the last stage and the first (stages started with `--feedback`).

The last stage streams each step's sampled tokens straight to the first (`FeedbackOutbox`); the
first stage's compute loop waits, before a step, until it knows every token the step computes (a
placeholder step planned before its input was sampled), and fails it instead when the scheduler
says that input will never come (`Abandon`) or resets the pipeline (`FeedbackInbox`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import grpc

from services import local_stream
from services.grpc_utils import aio_channel
from services.pb import worker_pb2, worker_pb2_grpc
from services.step import StepPlan
from worker_svc.execution.batch import PersistentBatch
from worker_svc.execution.runner import StageResult
from worker_svc.service.work import describe

log = logging.getLogger(__name__)


class FeedbackInbox:
    """The first stage's side: tokens fed by the last stage, not applied yet; sequences whose
    awaited tokens will not come; reset plans received and not computed; open streams.

    Filled on the event loop (the Feedback stream, Abandon, arriving plans), read by the step
    thread (`wait_inputs`, `plan_taken`): one lock over all of it, and a condition the
    waiting step sleeps on.

    Invariants (`check_integrity`): the counts are never negative; every fed entry is a
    (seq_id, position, token) triple of integers; abandoned ids are integers.
    """

    def __init__(self) -> None:
        self.fed: list[tuple[int, int, int]] = []  # (seq_id, position, token) not applied yet
        self.changed = threading.Condition()  # notified whenever a waiting step may go on or give up
        self.abandoned: set[int] = set()  # sequences whose awaited tokens will not come
        self.resets_queued = 0  # reset plans received, not yet computed
        self.num_streams = 0  # Feedback streams open now
        self.num_fed_tokens = 0  # tokens that came by feedback, not in a plan
        self.num_feedback_waits = 0  # steps that waited for a fed token
        self.num_abandoned = 0  # steps failed because their input never came

    # --- what comes in (the event loop) ------------------------------------------------

    def reset_received(self) -> None:
        """A reset plan arrived: a step waiting for its tokens gives up (`wait_inputs`)."""
        with self.changed:
            self.resets_queued += 1
            self.changed.notify()

    def stream_opened(self) -> None:
        with self.changed:
            self.num_streams += 1

    def stream_closed(self) -> None:
        with self.changed:
            self.num_streams -= 1
            self.changed.notify()  # a step waiting for tokens from this stream gives up

    def add(self, fb: worker_pb2.SampledFeedback) -> None:
        with self.changed:
            self.fed.extend(zip(fb.seq_ids, fb.positions, fb.token_ids, strict=True))
            self.changed.notify()

    def abandon(self, seq_ids) -> None:
        with self.changed:
            self.abandoned.update(seq_ids)
            self.changed.notify()

    # --- the step thread's side --------------------------------------------------------

    def plan_taken(self, plan: StepPlan) -> None:
        """A plan is about to run (or fail): a reset is consumed and forgets every abandoned
        sequence; otherwise sequences dropped or sent whole await nothing now."""
        with self.changed:
            if plan.reset:
                self.resets_queued -= 1
                self.abandoned.clear()
            elif self.abandoned:
                self.abandoned.difference_update(plan.finished_seq_ids)
                self.abandoned.difference_update(n.seq_id for n in plan.new_seqs)

    def wait_inputs(self, plan: StepPlan, batch: PersistentBatch) -> str | None:
        """Wait (the step thread) until this stage knows every token the step computes (fed
        by the last stage); None when it does, else why they will not come."""
        waited = False
        with self.changed:
            while True:
                if self.fed:
                    fed, self.fed = self.fed, []
                    self.num_fed_tokens += batch.feed(fed)
                awaiting = batch.awaiting(plan)
                if not awaiting:
                    self.num_feedback_waits += waited
                    return None
                lost = awaiting & self.abandoned
                if lost:
                    self.num_abandoned += 1
                    return f"its input tokens of sequences {sorted(lost)} will not come (their step failed)"
                if self.resets_queued > (1 if plan.reset else 0):
                    self.num_abandoned += 1
                    return "the pipeline was reset before its input tokens came"
                if not self.num_streams:
                    self.num_abandoned += 1
                    return "no feedback stream from the last stage is open to bring its input tokens"
                waited = True
                self.changed.wait()

    def check_integrity(self) -> None:
        with self.changed:
            assert self.resets_queued >= 0, self.resets_queued
            assert self.num_streams >= 0, self.num_streams
            assert min(self.num_fed_tokens, self.num_feedback_waits, self.num_abandoned) >= 0
            assert all(len(t) == 3 and all(isinstance(v, int) for v in t) for t in self.fed), self.fed[:4]
            assert all(isinstance(s, int) for s in self.abandoned), self.abandoned


class FeedbackOutbox:
    """The last stage's side: one Feedback stream kept open to the first stage (from start, so
    that the scheduler finds it open), each step's sampled tokens written to it; it reconnects
    when the stream breaks (tokens lost with it are the scheduler's to recover: the first stage
    restarted, and its new epoch resets the pipeline)."""

    def __init__(self, address: str, max_message_bytes: int, stats=None, local: bool = True) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.stats = stats  # its control_channel: how the tokens go (worker_svc/service/statistics.py)
        self.local = local  # the first stage's local socket taken when it offers one (on this host)
        # tokens to write, or a stream's end (`_wake_writer`)
        self.queue: asyncio.Queue[worker_pb2.SampledFeedback | asyncio.Future] = asyncio.Queue(maxsize=1024)
        self.channel: grpc.aio.Channel | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the compute loop starts
        self._call = None  # the stream open now
        self._direct = local_stream.DirectWrites()  # the step thread's own writes, in order with the loop's

    @staticmethod
    def of(result: StageResult | None, micro_batch_id: int) -> worker_pb2.SampledFeedback | None:
        """A step's sampled tokens as the first stage reads them (None: it sampled none)."""
        if result is None or result.sampled is None or not result.sampled_seq_ids:
            return None
        fb = worker_pb2.SampledFeedback(micro_batch_id=micro_batch_id)
        fb.seq_ids.extend(result.sampled_seq_ids)
        fb.positions.extend(result.sampled_positions)
        fb.token_ids.extend(result.sampled.token_ids)
        return fb

    def start(self) -> asyncio.Task:
        self.channel = aio_channel(self.address, self.max_message_bytes)
        return asyncio.create_task(self._write_loop(), name="feedback")

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    def send(self, fb: worker_pb2.SampledFeedback | None, micro_batch_id: int) -> None:
        """The step thread: a step's tokens, straight onto the first stage's local socket when
        nothing waits before them, else for the writer on the event loop."""
        if fb is None:
            return
        call = self._call
        if not self._direct.take(call):
            self.loop.call_soon_threadsafe(self._put, fb, micro_batch_id)
            return
        try:
            call.send_now(fb)
        except local_stream.LocalStreamError as exc:  # the stream broke: its writer reconnects
            log.warning("step %d's tokens lost with the feedback stream: %s", micro_batch_id, describe(exc))

    def _put(self, fb: worker_pb2.SampledFeedback, micro_batch_id: int) -> None:
        try:
            self.queue.put_nowait(fb)
        except asyncio.QueueFull:
            self._direct.written()
            log.error(
                "feedback queue full: the first stage at %s is not reading; dropping step %d's tokens",
                self.address,
                micro_batch_id,
            )

    async def _write_loop(self) -> None:
        stub = worker_pb2_grpc.StageWorkerStub(self.channel)
        while True:
            call = None
            try:
                await asyncio.wait_for(self.channel.channel_ready(), timeout=2.0)
                if self.local:
                    call = await local_stream.try_open(stub, "Feedback", max_message_bytes=self.max_message_bytes)
                if call is None:
                    call = stub.Feedback()
                if self.stats is not None:
                    self.stats.control_channel = "unix" if isinstance(call, local_stream.LocalCall) else "grpc"
                await self._write_until_broken(call)
                self._call = None
            except asyncio.CancelledError:
                if call is not None:
                    call.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of the stream means the same
                log.warning("feedback to the first stage at %s failed: %s", self.address, describe(exc))
            self._call = None
            if call is not None:
                call.cancel()
            await asyncio.sleep(0.2)

    async def _write_until_broken(self, call) -> None:
        await call.write(worker_pb2.SampledFeedback())  # opens the stream on the first stage
        ended = asyncio.ensure_future(call)  # done only when the stream breaks
        ended.add_done_callback(self._wake_writer)
        log.info("feedback stream to the first stage at %s open", self.address)
        self._call = call  # (the step thread writes on it itself while nothing waits here)
        while True:
            fb = await self.queue.get()
            if fb is ended:  # the stream broke while nothing was to be written
                break
            if isinstance(fb, asyncio.Future):  # a stream before this one
                continue
            try:
                await call.write(fb)
            finally:
                self._direct.written()
        reason = describe(ended.exception()) if ended.exception() else "closed"
        log.warning("feedback stream to %s ended: %s", self.address, reason)

    def _wake_writer(self, ended: asyncio.Future) -> None:
        """The stream broke: its writer, waiting for tokens, reconnects now (one `get` per
        write, no per-write wait on the stream's end)."""
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(ended)
