"""The stage's compute loop: micro-batches decoded on the event loop as they arrive (overlapping
the step computing now), then run in arrival order on the step thread (service/step_thread.py;
torch; on an emulated device that thread sleeps the step time the profile predicts instead:
worker_svc/execution/emulated.py), which also builds what the step hands on — the next stage's
micro-batch, the first stage's fed tokens, the scheduler's report — and counts a step handed
on, so the event loop only routes what must go through it (the last stage's report, a
failure). A malformed plan fails that micro-batch only (an error event with a status
code); whatever one plan raises fails that plan alone, never the thread; should the thread end
anyway, the stage stops serving (`fatal`: the process exits and its supervisor restarts it)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from services import telemetry
from services.grpc_utils import status_from_value
from services.pb import worker_pb2
from services.step_codec import PlanDecodeError, plan_from_pb, result_to_pb
from worker_svc.config import WorkerConfig
from worker_svc.errors import InvalidPlanError, LoraNotLoadedError
from worker_svc.execution.data_plane import DataPlaneError, DataPlaneIn, DataPlaneOut, received
from worker_svc.execution.kv_tier import TierMissError
from worker_svc.service.downstream import Downstream
from worker_svc.service.feedback import FeedbackInbox, FeedbackOutbox
from worker_svc.service.statistics import StageStatistics
from worker_svc.service.step_thread import StepThread
from worker_svc.service.work import Work, failed_done

log = logging.getLogger(__name__)
MAX_QUEUED = 64  # micro-batches accepted and not yet taken by the step thread: then Forward waits


class ComputeLoop:
    def __init__(
        self,
        config: WorkerConfig,
        runner,
        stats: StageStatistics,
        inbox: FeedbackInbox,
        data_in: DataPlaneIn,
        data_out: DataPlaneOut | None,
        emit: Callable[[worker_pb2.MicroBatchDone], None],
    ) -> None:
        self.config, self.runner, self.stats, self.inbox = config, runner, stats, inbox
        self.data_in, self.data_out = data_in, data_out
        self.emit = emit  # a micro-batch's report to the Events subscribers
        self.thread = StepThread(f"stage{config.stage}", on_death=self._died)
        self.executor = self.thread  # LoRA loads and KV reads run there too, between steps
        self.downstream: Downstream | None = None  # set by the service (not the last stage)
        self.outbox: FeedbackOutbox | None = None  # set by the service (the last stage of several)
        self.fatal: BaseException | None = None  # why the step thread ended, if it did
        self.on_fatal: Callable[[], None] | None = None  # called then
        self._tracing = telemetry.enabled()
        self._tracer = telemetry.tracer("pagoda.worker")
        self._posted = 0  # micro-batches posted to the step thread (the event loop counts)
        self._taken = 0  # ... and done there (the step thread counts)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._death: asyncio.Future | None = None

    # --- arrival (the Forward handler, on the event loop) --------------------------------

    async def accept(self, mb: worker_pb2.MicroBatch) -> None:
        """Takes a received micro-batch: counted, decoded while the plan before it computes,
        posted to the step thread in arrival order (waits while MAX_QUEUED are there)."""
        work = Work(mb=mb, upstream_sent_ns=mb.sent_ns)
        self.stats.received(mb)
        self._decode(work)
        work.received_ns = time.time_ns()
        if work.plan is not None and work.plan.reset:
            self.inbox.reset_received()
        tier = getattr(self.runner, "kv_tier", None)
        if tier is not None and work.plan is not None and work.plan.tier_ops:
            tier.prefetch(work.plan.tier_ops)  # its disk reads overlap the steps ahead of it
        self._loop = self._loop or asyncio.get_running_loop()
        while self._posted - self._taken >= MAX_QUEUED:  # back-pressure on the stream
            await asyncio.sleep(0.002)
        self._posted += 1
        self.thread.post(self._step, work)

    def _decode(self, work: Work) -> None:
        mb, cfg = work.mb, self.config
        try:
            if not cfg.is_first:  # first, whatever the plan: a link's receives pair with its sends in order
                work.hidden, work.release = self.data_in.hidden(mb)  # released (a ring's slot) after compute
            if mb.stage_index != cfg.stage:
                raise InvalidPlanError(
                    f"micro-batch {mb.micro_batch_id} is addressed to stage {mb.stage_index}, this is stage {cfg.stage}"
                )
            try:
                plan = plan_from_pb(mb)
            except PlanDecodeError as exc:
                raise InvalidPlanError(str(exc)) from None
            if plan.num_tokens > cfg.max_num_batched_tokens:
                raise InvalidPlanError(
                    f"micro-batch {mb.micro_batch_id} has {plan.num_tokens} tokens, over this stage's "
                    f"max_num_batched_tokens={cfg.max_num_batched_tokens}"
                )
            work.plan = plan  # only a plan within limits is kept (its counts go into replies)
        except InvalidPlanError as exc:
            work.error = (grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    # --- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        """Waits, on the event loop, until the step thread dies (it should not): then the
        stage stops serving."""
        self._loop = asyncio.get_running_loop()
        self._death = self._loop.create_future()
        if self.downstream is not None:
            self.downstream.loop = self._loop
        if self.outbox is not None:
            self.outbox.loop = self._loop
        exc = await self._death
        log.critical("the compute loop died: %s", exc)
        self.fatal = exc
        if self.on_fatal is not None:
            self.on_fatal()
        raise exc

    def _died(self, exc: BaseException) -> None:  # (the step thread)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: self._death.done() or self._death.set_result(exc))

    # --- the step thread ---------------------------------------------------------------

    def _step(self, work: Work) -> None:
        try:
            self._process(work)
        except Exception as exc:  # a bug outside the model: this step fails, the thread goes on
            log.exception("micro-batch %d failed outside compute", work.mb.micro_batch_id)
            done = failed_done(work.mb.micro_batch_id, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            self._loop.call_soon_threadsafe(self._report_alone, done)
        finally:
            work.hidden = None
            if work.release is not None:  # done or failed: its ring slot goes back
                work.release()
            self._taken += 1

    def _process(self, work: Work) -> None:
        if work.error is None and self.config.is_first and not self.config.is_last:
            why = self.inbox.wait_inputs(work.plan, self.runner.batch)
            if why is not None:
                work.error = (grpc.StatusCode.ABORTED, f"micro-batch {work.mb.micro_batch_id}: {why}")
        if work.plan is not None:
            self.inbox.plan_taken(work.plan)
        if work.error is None:
            self._compute_guarded(work)
        # the fed tokens go to the first stage as soon as compute ends, before the scheduler
        # hears of the step (a failed hand-off is reported afterwards as an error for it)
        if work.error is None and self.outbox is not None:
            self.outbox.send(work.feedback, work.mb.micro_batch_id)
        done = self._done(work)
        if done.error.code or self.config.is_last:
            self._loop.call_soon_threadsafe(self._report, done)
        else:  # a step handed on: only counted, here (no event-loop wake-up per step)
            self._count(done)
        if work.error is None and self.downstream is not None:
            self.downstream.submit(work)

    def _compute_guarded(self, work: Work) -> None:
        try:
            self._compute(work)
        except LoraNotLoadedError as exc:  # (the scheduler loads the stage's adapters again)
            work.error = (grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except InvalidPlanError as exc:
            work.error = (grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except DataPlaneError as exc:  # the link's receive failed: the previous stage went
            work.error = (grpc.StatusCode.UNAVAILABLE, str(exc))
        except TierMissError as exc:  # a tier block lost or corrupt: the KV manager forgets it, the step is recomputed
            work.error = (grpc.StatusCode.DATA_LOSS, str(exc))
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("micro-batch %d failed", work.mb.micro_batch_id)
            work.error = (grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _compute(self, work: Work) -> None:
        """The only place this stage's tensors are touched. What the step hands on is
        encoded here too: the hidden states into the micro-batch (not last), the sampled
        tokens into the first stage's feedback (last of several)."""
        progress = self.stats.progress
        work.compute_start_ns = time.time_ns()
        progress.step_started(work.mb.micro_batch_id)
        try:
            work.result = self.runner.execute(work.plan, received(work.hidden))
        finally:
            progress.step_ended()
        work.compute_end_ns = time.time_ns()
        work.hidden = None
        if work.result.hidden is not None and self.data_out is not None:
            work.out_hidden = self.data_out.pack(work.result.hidden, work.mb)
            work.result.hidden = None
        if self.outbox is not None:
            work.feedback = self.outbox.of(work.result, work.mb.micro_batch_id)

    def _done(self, work: Work) -> worker_pb2.MicroBatchDone:
        """The step's report, built on the step thread (the result it reads is the thread's
        until the next step): its timing; on the last stage every stage's timing and the
        sampled tokens, elsewhere the timing appended to the micro-batch handed on
        (MicroBatch.upstream_timings): one event per step for the scheduler to read, not one
        per stage."""
        done = worker_pb2.MicroBatchDone(micro_batch_id=work.mb.micro_batch_id)
        timing = done.timing
        timing.stage_index = self.config.stage
        timing.sent_ns = work.upstream_sent_ns
        timing.received_ns = work.received_ns
        timing.compute_start_ns = work.compute_start_ns
        timing.compute_end_ns = work.compute_end_ns
        if work.plan is not None:
            timing.num_seqs = work.plan.num_seqs
            timing.num_tokens = work.plan.num_tokens
        if work.error is not None:
            code, message = work.error
            done.error.code = code.value[0]
            done.error.message = message
            return done
        done.num_block_copies_applied = len(work.plan.block_copies)
        if self._tracing:
            self._trace_spans(work)
        if not self.config.is_last:
            work.mb.upstream_timings.append(timing)
            return done
        done.upstream_timings.extend(work.mb.upstream_timings)
        if work.result.sampled is not None:
            result_to_pb(work.result.step_result(), done)
        return done

    # --- reports (the event loop) ------------------------------------------------------

    def _report_alone(self, done: worker_pb2.MicroBatchDone) -> None:
        self.stats.finished(failed=True)
        self.emit(done)

    def report_forward_failure(self, work: Work) -> None:
        code, message = work.error
        self.stats.num_failed += 1
        log.warning("micro-batch %d not handed on: %s %s", work.mb.micro_batch_id, code.name, message)
        self.emit(failed_done(work.mb.micro_batch_id, code, message))

    def _report(self, done: worker_pb2.MicroBatchDone) -> None:
        """Count the step and report it: a failure at once on Events; a success on Events
        from the last stage only (with every stage's timing; the others count theirs on the
        step thread)."""
        if done.error.code:
            self.stats.finished(failed=True)
            code = status_from_value(done.error.code)
            log.warning("micro-batch %d failed: %s %s", done.micro_batch_id, code.name, done.error.message)
            self.emit(done)
            return
        self._count(done)
        self.emit(done)

    def _count(self, done: worker_pb2.MicroBatchDone) -> None:
        t = done.timing
        self.stats.finished(t.num_tokens, t.compute_end_ns - t.compute_start_ns, done.num_block_copies_applied)

    def _trace_spans(self, work: Work) -> None:
        """One span per traced sequence of the micro-batch, under its request's scheduler span."""
        mb_id, num_tokens = work.mb.micro_batch_id, work.plan.num_tokens
        for row in work.result.rows:
            parent = telemetry.context_from(row.state.trace_context)
            if parent is None:
                continue
            span = self._tracer.start_span(
                f"stage{self.config.stage}.compute",
                context=parent,
                start_time=work.compute_start_ns,
                attributes={
                    "pagoda.stage": self.config.stage,
                    "pagoda.micro_batch_id": mb_id,
                    "pagoda.seq_id": row.seq_id,
                    "pagoda.num_tokens": num_tokens,
                },
            )
            span.end(end_time=work.compute_end_ns)
