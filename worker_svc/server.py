"""The stage worker as a gRPC service (`pagoda.v1.StageWorker`).

Data flows down the chain only: the upstream side (the scheduler for stage 0, stage K for
stage K+1) opens one long-lived `Forward` stream of micro-batches; results go straight back
on `Events` streams that the scheduler holds from every stage.

Inside a stage three things overlap, each with one owner:
- the `Forward` handler (event loop) receives and decodes the next micro-batch,
- the compute loop runs plans in arrival order on one executor thread (torch; on an emulated
  device, `--device emulated:PROFILE`, that thread sleeps the step time the profile predicts
  instead: worker_svc/execution/emulated.py),
- the sender (event loop, not on the last stage) encodes and writes hidden states
  downstream while the next micro-batch computes.
With several stages started with `--feedback` (on the last), the last stage streams each
step's sampled tokens straight to the first (`Feedback`); the first stage's compute loop
waits, before a step, until it knows every token the step computes (a placeholder step
planned before its input was sampled), and fails it instead when the scheduler says that
input will never come (`Abandon`) or resets the pipeline.
A malformed plan fails that micro-batch only (an error event with a status code); the stage
keeps serving. A broken downstream stream fails the micro-batches it could not take with
UNAVAILABLE, and the sender reconnects for the next one (a restarted stage has a new epoch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from services import telemetry
from services.grpc_utils import aio_channel, create_aio_server, drain_requests, serve_until_signalled, set_serving
from services.pb import common_pb2, worker_pb2, worker_pb2_grpc
from services.settings import lora_modules
from services.step import StepPlan
from services.step_codec import PlanDecodeError, plan_from_pb, result_to_pb
from worker_svc.checkpoints.convert import dtype_to_pb
from worker_svc.config import WorkerConfig
from worker_svc.errors import InvalidPlanError, LoraNotLoadedError
from worker_svc.execution import stage_ring
from worker_svc.execution.data_plane import DataPlaneError, DataPlaneIn, DataPlaneOut, received
from worker_svc.execution.drafter import drafter_for
from worker_svc.execution.progress import StageProgress
from worker_svc.execution.runner import StageResult, StageRunner
from worker_svc.kernels.calibrate import describe_cpu
from worker_svc.models.stage import StageModel
from worker_svc.weights.lora import LoraBankFullError, bank_for, load_adapter

if TYPE_CHECKING:
    from worker_svc.execution.emulated import EmulatedRunner

log = logging.getLogger(__name__)
SERVICE_NAME = "pagoda.v1.StageWorker"


@dataclass
class _Work:
    """One micro-batch on its way through this stage."""

    mb: worker_pb2.MicroBatch
    upstream_sent_ns: int
    received_ns: int = 0
    plan: StepPlan | None = None
    hidden: torch.Tensor | None = None
    error: tuple[grpc.StatusCode, str] | None = None
    result: StageResult | None = None
    compute_start_ns: int = 0
    compute_end_ns: int = 0
    forwarded_ns: int = 0
    feedback: worker_pb2.SampledFeedback | None = None  # the last stage's tokens for the first
    release: Callable[[], None] | None = None  # hands back the ring slot `hidden` lies in
    out_hidden: torch.Tensor | None = None  # the step's output until handed on (data_plane.py)


class StageService(worker_pb2_grpc.StageWorkerServicer):
    def __init__(self, config: WorkerConfig, runner: StageRunner | EmulatedRunner) -> None:
        self.config = config
        self.runner = runner
        self.kv_sizing = None  # worker_svc.execution.memory.KVSizing when the pool was sized from memory
        self.weights_bytes = runner.weights_bytes  # packed GGUF rows at their packed size; none emulated
        self.expert_weights_bytes = runner.expert_weights_bytes
        self.epoch = secrets.randbits(63) | 1  # a new id per process start; never 0
        self.started_ns = time.time_ns()
        self.max_message_bytes = config.max_message_bytes(runner.model.config.hidden_size)
        self._queue: asyncio.Queue[_Work] = asyncio.Queue(maxsize=64)
        self._send_queue: asyncio.Queue[_Work] = asyncio.Queue(maxsize=64)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{config.stage}")
        self._subscribers: set[asyncio.Queue] = set()
        self._tasks: list[asyncio.Task] = []
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        # the data plane (worker_svc/execution/data_plane.py): hidden states to the next stage and from the previous
        hidden_size, device = runner.model.config.hidden_size, getattr(runner, "device", "cpu")
        self.data_out = (
            None
            if config.is_last
            else DataPlaneOut(
                config.stage_channel,
                config.stage,
                stage_ring.slot_bytes_for(config.max_num_batched_tokens, hidden_size),
                device=device,
                host=config.host,
            )
        )
        self.data_in = DataPlaneIn(config.stage_channel, device)
        # sampled-token feedback (the first stage receives it, the last stage sends it)
        self._fed: list[tuple[int, int, int]] = []  # (seq_id, position, token) not applied yet
        self._fed_event = asyncio.Event()
        self._abandoned: set[int] = set()  # sequences whose awaited tokens will not come
        self._resets_queued = 0  # reset plans received, not yet computed
        self._feedback_streams = 0  # first stage: Feedback streams open now
        # tokens to write, or a stream's end (`_wake_feedback_writer`)
        self._feedback_queue: asyncio.Queue[worker_pb2.SampledFeedback | asyncio.Future] = asyncio.Queue(maxsize=1024)
        self._feedback_channel: grpc.aio.Channel | None = None
        self._downstream_task: asyncio.Task | None = None
        self.downstream_connected = False
        self.fatal: BaseException | None = None  # why the compute loop ended, if it did
        self.on_fatal = None  # called then (serve(): the process exits, to be restarted)
        self._tracing = telemetry.enabled()
        self._tracer = telemetry.tracer("pagoda.worker")
        # statistics
        self.busy_ns = 0
        self.num_micro_batches = 0
        self.num_failed = 0
        self.num_tokens = 0
        self.num_in_flight = 0
        self.peak_in_flight = 0
        self.num_block_copies = 0
        self.num_received_bytes = 0
        self.num_sent_bytes = 0
        self.num_fed_tokens = 0  # first stage: tokens that came by feedback, not in a plan
        self.num_feedback_waits = 0  # first stage: steps that waited for a fed token
        self.num_abandoned = 0  # first stage: steps failed because their input never came
        # ticks of the compute thread (per layer): a slow step from a hung stage
        self.progress = StageProgress()
        model = getattr(runner, "model", None)
        if isinstance(model, StageModel):
            model.on_layer = self.progress.tick
        self.cpu = describe_cpu(runner.device_name)

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._compute_loop(), name="compute"))
        if not self.config.is_last:
            self._channel = aio_channel(self.config.next_address, self.max_message_bytes)
            self._tasks.append(asyncio.create_task(self._sender_loop(), name="sender"))
        if self.config.feedback_address:
            self._feedback_channel = aio_channel(self.config.feedback_address, self.max_message_bytes)
            self._tasks.append(asyncio.create_task(self._feedback_loop(), name="feedback"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._downstream_task:
            self._downstream_task.cancel()
        if self._channel is not None:
            await self._channel.close()
        if self._feedback_channel is not None:
            await self._feedback_channel.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- rpcs --------------------------------------------------------------------------

    async def Forward(self, request_iterator, context):
        count = 0
        async for mb in request_iterator:
            count += 1
            work = _Work(mb=mb, upstream_sent_ns=mb.sent_ns)
            self.num_received_bytes += mb.ByteSize() + _shared_bytes(mb)  # the message, and what it refers to
            self.num_in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.num_in_flight)
            self._decode(work)  # overlaps with the plan computing now
            work.received_ns = time.time_ns()
            if work.plan is not None and work.plan.reset:
                self._resets_queued += 1  # a step waiting for its tokens gives up (_await_inputs)
                self._fed_event.set()
            await self._queue.put(work)
        return worker_pb2.ForwardSummary(num_micro_batches=count)

    async def Feedback(self, request_iterator, context):
        """The last stage's sampled tokens (first stage): applied between steps."""
        if not self.config.is_first or self.config.is_last:
            await drain_requests(request_iterator)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "only the first stage of several takes sampled-token feedback"
            )
        self._feedback_streams += 1
        log.info("feedback stream from %s connected", context.peer())
        try:
            async for fb in request_iterator:
                if len(fb.seq_ids) != len(fb.positions) or len(fb.seq_ids) != len(fb.token_ids):
                    await drain_requests(request_iterator)
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"feedback of step {fb.micro_batch_id}: columns of unequal length",
                    )
                self._fed.extend(zip(fb.seq_ids, fb.positions, fb.token_ids, strict=True))
                self._fed_event.set()
        finally:
            self._feedback_streams -= 1
            self._fed_event.set()  # a step waiting for tokens from this stream gives up
        return worker_pb2.FeedbackAck()

    async def Abandon(self, request, context):
        if request.epoch in (0, self.epoch):
            self._abandoned.update(request.seq_ids)
            self._fed_event.set()
        return worker_pb2.AbandonReply()

    async def LoadLoraAdapter(self, request, context):
        return await self._lora_call(context, "load", request.lora_name, request.lora_path, request.load_id)

    async def UnloadLoraAdapter(self, request, context):
        return await self._lora_call(context, "unload", request.lora_name, "")

    async def _lora_call(self, context, what: str, name: str, path: str, load_id: int = 0):
        """Loads or unloads an adapter on the compute thread (between steps: a step never
        sees a slot half written). A full bank is FAILED_PRECONDITION: retrying does not
        free a slot."""
        bank = self.runner.lora if isinstance(self.runner, StageRunner) else None
        if bank is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA is off on this stage (--enable-lora)")
        if not name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name: required")

        def apply() -> tuple[grpc.StatusCode, str] | None:
            if what == "unload":
                if bank.slot_of(name) is None:
                    return grpc.StatusCode.NOT_FOUND, f"lora_name: no adapter {name!r} is loaded"
                bank.remove(name)
                return None
            if bank.slot_of(name) is not None:
                return grpc.StatusCode.ALREADY_EXISTS, f"lora_name: an adapter {name!r} is loaded already"
            try:
                model = self.runner.model
                bank.add(
                    name, load_adapter(path, model.config, model.start, model.end, max_rank=bank.max_rank), load_id
                )
            except LoraBankFullError as exc:
                return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
            except (ValueError, OSError) as exc:
                return grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: {exc}"
            return None

        failed = await asyncio.get_running_loop().run_in_executor(self._executor, apply)
        if failed is not None:
            await context.abort(*failed)
        log.info("LoRA adapter %r %sed; held: %s", name, what, list(bank.names))
        return worker_pb2.LoraAdapterReply(lora_names=list(bank.names), lora_adapters=self._lora_adapters())

    async def Events(self, request, context):
        queue: asyncio.Queue = asyncio.Queue(maxsize=100_000)
        self._subscribers.add(queue)
        log.info("events subscriber %r connected", request.subscriber or context.peer())
        try:
            yield worker_pb2.StageEvent(stage_index=self.config.stage, epoch=self.epoch, ready=self.load_info())
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)

    async def OpenDataPlane(self, request, context):
        if self.config.is_first:
            return worker_pb2.DataPlaneReply(
                channel=worker_pb2.DATA_CHANNEL_GRPC, reason="the first stage takes no hidden states"
            )
        return await self.data_in.accept(request)

    async def LoadInfo(self, request, context):
        return self.load_info()

    async def GetStats(self, request, context):
        return self.stats()

    async def Health(self, request, context):
        return worker_pb2.StageHealth(
            status=common_pb2.HEALTH_STATUS_NOT_SERVING if self.fatal else common_pb2.HEALTH_STATUS_SERVING,
            stage_index=self.config.stage,
            epoch=self.epoch,
            downstream_connected=self.config.is_last or self.downstream_connected,
            device=self.runner.device_name,
        )

    # --- views -------------------------------------------------------------------------

    def load_info(self) -> worker_pb2.StageLoadInfo:
        model, cfg = self.runner.model, self.config
        return worker_pb2.StageLoadInfo(
            stage_index=cfg.stage,
            num_stages=cfg.num_stages,
            layer_start=model.start,
            layer_end=model.end,
            num_layers=model.config.num_layers,
            num_kv_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            dtype=dtype_to_pb(self.runner.dtype),
            kv_cache_dtype=dtype_to_pb(self.runner.kv_dtype),
            model=cfg.model,
            epoch=self.epoch,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            hidden_size=model.config.hidden_size,
            vocab_size=model.config.vocab_size,
            max_message_bytes=self.max_message_bytes,
            next_address=cfg.next_address or "",
            num_threads=torch.get_num_threads(),
            device=self.runner.device_name,
            quantization=model.weight_format or cfg.quantization,
            feedback_address=cfg.feedback_address or "",
            feedback_connected=self._feedback_streams > 0,
            kv_block_bytes=self.runner.kv_block_bytes,
            memory_total_bytes=self.kv_sizing.total_bytes if self.kv_sizing else 0,
            memory_budget_bytes=self.kv_sizing.budget_bytes if self.kv_sizing else 0,
            memory_baseline_bytes=self.kv_sizing.baseline_bytes if self.kv_sizing else 0,
            weights_bytes=self.kv_sizing.weights_bytes if self.kv_sizing else self.weights_bytes,
            activation_peak_bytes=self.kv_sizing.activation_bytes if self.kv_sizing else 0,
            expert_weights_bytes=self.expert_weights_bytes,
            tensor_parallel_size=cfg.tensor_parallel_size,
            lora_adapters=self._lora_adapters(),
            cpu=self.cpu,
            kv_groups=model.config.kv_layout.spec(),
            data_channel=self.data_out.channel if self.data_out else "",
        )

    def _lora_adapters(self) -> list[worker_pb2.LoraAdapterInfo]:
        """The LoRA adapters this stage holds (none with LoRA off)."""
        bank = self.runner.lora if isinstance(self.runner, StageRunner) else None
        return [
            worker_pb2.LoraAdapterInfo(lora_name=h.name, lora_path=h.folder, load_id=h.load_id)
            for h in (bank.held if bank is not None else ())
        ]

    def stats(self) -> worker_pb2.StageStats:
        uptime, out = time.time_ns() - self.started_ns, self.data_out
        return worker_pb2.StageStats(
            stage_index=self.config.stage,
            epoch=self.epoch,
            busy_ns=self.busy_ns,
            idle_ns=max(0, uptime - self.busy_ns),
            num_micro_batches=self.num_micro_batches,
            num_failed_micro_batches=self.num_failed,
            num_tokens=self.num_tokens,
            num_in_flight=self.num_in_flight,
            peak_in_flight=self.peak_in_flight,
            num_block_copies=self.num_block_copies,
            num_received_bytes=self.num_received_bytes,
            num_sent_bytes=self.num_sent_bytes,
            num_fed_tokens=self.num_fed_tokens,
            num_feedback_waits=self.num_feedback_waits,
            num_abandoned=self.num_abandoned,
            num_progress_ticks=self.progress.num_ticks,
            progress_age_ns=self.progress.age_ns(),
            computing_micro_batch_id=self.progress.micro_batch_id,
            cpu=self.cpu,
            uptime_ns=uptime,
            data_channel=out.channel if out else "",
            upstream_channel=self.data_in.channel,
            num_ring_full_waits=out.num_full_waits if out else 0,
            num_shm_sent=out.num_shm_sent if out else 0,
            num_grpc_sent=out.num_grpc_sent if out else 0,
            num_p2p_sent=out.num_p2p_sent if out else 0,
        )

    # --- the pipeline inside a stage ---------------------------------------------------

    def _decode(self, work: _Work) -> None:
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
            num_tokens = plan.num_tokens
            if num_tokens > cfg.max_num_batched_tokens:
                raise InvalidPlanError(
                    f"micro-batch {mb.micro_batch_id} has {num_tokens} tokens, over this stage's "
                    f"max_num_batched_tokens={cfg.max_num_batched_tokens}"
                )
            work.plan = plan  # only a plan within limits is kept (its counts go into replies)
        except InvalidPlanError as exc:
            work.error = (grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _compute_loop(self) -> None:
        """Runs plans in arrival order. Whatever one plan raises fails that plan alone (an
        error event), never the loop; should the loop end anyway, the stage stops serving
        (`fatal`: the process exits and its supervisor restarts it)."""
        try:
            while True:
                work = await self._queue.get()
                try:
                    await self._process(work)
                except Exception as exc:  # a bug outside the model: this step fails, the loop goes on
                    log.exception("micro-batch %d failed outside compute", work.mb.micro_batch_id)
                    self._fail_alone(work, f"{type(exc).__name__}: {exc}")
                finally:
                    work.hidden = None
                    if work.release is not None:  # done or failed: its ring slot goes back
                        work.release()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.critical("the compute loop died: %s", exc)
            self.fatal = exc
            if self.on_fatal is not None:
                self.on_fatal()
            raise

    def _fail_alone(self, work: _Work, message: str) -> None:
        done = worker_pb2.MicroBatchDone(micro_batch_id=work.mb.micro_batch_id)
        done.error.code = grpc.StatusCode.INTERNAL.value[0]
        done.error.message = message
        self.num_failed += 1
        self.num_in_flight = max(0, self.num_in_flight - 1)
        self._emit(worker_pb2.StageEvent(stage_index=self.config.stage, epoch=self.epoch, done=done))

    async def _process(self, work: _Work) -> None:
        loop = asyncio.get_running_loop()
        if work.error is None and self.config.is_first and not self.config.is_last:
            why = await self._await_inputs(work.plan)
            if why is not None:
                self.num_abandoned += 1
                work.error = (grpc.StatusCode.ABORTED, f"micro-batch {work.mb.micro_batch_id}: {why}")
        if work.plan is not None:
            if work.plan.reset:
                self._resets_queued -= 1
                self._abandoned.clear()
            elif self._abandoned:  # dropped or sent whole: nothing awaited for them now
                self._abandoned.difference_update(work.plan.finished_seq_ids)
                self._abandoned.difference_update(n.seq_id for n in work.plan.new_seqs)
        if work.error is None:
            try:
                await loop.run_in_executor(self._executor, self._compute, work)
            except LoraNotLoadedError as exc:  # (the scheduler loads the stage's adapters again)
                work.error = (grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except InvalidPlanError as exc:
                work.error = (grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except DataPlaneError as exc:  # the link's receive failed: the previous stage went
                work.error = (grpc.StatusCode.UNAVAILABLE, str(exc))
            except Exception as exc:  # a bug: report it, keep serving
                log.exception("micro-batch %d failed", work.mb.micro_batch_id)
                work.error = (grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        # the result goes back to the scheduler as soon as compute ends, before the
        # hand-off downstream, so that it reaches the scheduler ahead of the later stages'
        # (a failed hand-off is reported afterwards as an error for the micro-batch)
        if work.error is None and self.config.feedback_address:
            self._send_feedback(work)  # before the scheduler hears of it: the next step waits
        self._finish(work)
        if work.error is None and not self.config.is_last:
            await self._send_queue.put(work)

    async def _await_inputs(self, plan: StepPlan) -> str | None:
        """Wait until this stage knows every token the step computes (fed by the last stage);
        None when it does, else why they will not come."""
        batch, waited = self.runner.batch, False
        while True:
            if self._fed:
                fed, self._fed = self._fed, []
                self.num_fed_tokens += batch.feed(fed)
            awaiting = batch.awaiting(plan)
            if not awaiting:
                self.num_feedback_waits += waited
                return None
            lost = awaiting & self._abandoned
            if lost:
                return f"its input tokens of sequences {sorted(lost)} will not come (their step failed)"
            if self._resets_queued > (1 if plan.reset else 0):
                return "the pipeline was reset before its input tokens came"
            if not self._feedback_streams:
                return "no feedback stream from the last stage is open to bring its input tokens"
            waited = True
            self._fed_event.clear()
            await self._fed_event.wait()

    async def _feedback_loop(self) -> None:
        """Last stage: keep a Feedback stream open to the first stage (from start, so that
        the scheduler finds it open) and write each step's sampled tokens to it; reconnect
        when it breaks (tokens lost with it are the scheduler's to recover: the first stage
        restarted, and its new epoch resets the pipeline)."""
        stub = worker_pb2_grpc.StageWorkerStub(self._feedback_channel)
        while True:
            call = ended = None
            try:
                await asyncio.wait_for(self._feedback_channel.channel_ready(), timeout=2.0)
                call = stub.Feedback()
                await call.write(worker_pb2.SampledFeedback())  # opens the stream on the first stage
                ended = asyncio.ensure_future(call)  # done only when the stream breaks
                ended.add_done_callback(self._wake_feedback_writer)
                log.info("feedback stream to the first stage at %s open", self.config.feedback_address)
                while True:
                    fb = await self._feedback_queue.get()
                    if fb is ended:  # the stream broke while nothing was to be written
                        break
                    if isinstance(fb, asyncio.Future):  # a stream before this one
                        continue
                    await call.write(fb)
                log.warning(
                    "feedback stream to %s ended: %s",
                    self.config.feedback_address,
                    _describe(ended.exception()) if ended.exception() else "closed",
                )
            except asyncio.CancelledError:
                if call is not None:
                    call.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of the stream means the same
                log.warning(
                    "feedback to the first stage at %s failed: %s", self.config.feedback_address, _describe(exc)
                )
            if call is not None:
                call.cancel()
            await asyncio.sleep(0.2)

    def _wake_feedback_writer(self, ended: asyncio.Future) -> None:
        """The feedback stream broke: its writer, waiting for tokens, reconnects now (one
        `get` per write, no per-write wait on the stream's end)."""
        with contextlib.suppress(asyncio.QueueFull):
            self._feedback_queue.put_nowait(ended)

    def _send_feedback(self, work: _Work) -> None:
        if work.feedback is None:
            return
        try:
            self._feedback_queue.put_nowait(work.feedback)
        except asyncio.QueueFull:
            log.error(
                "feedback queue full: the first stage at %s is not reading; dropping step %d's tokens",
                self.config.feedback_address,
                work.mb.micro_batch_id,
            )

    @staticmethod
    def _feedback_of(work: _Work) -> worker_pb2.SampledFeedback | None:
        result = work.result
        if result is None or result.sampled is None or not result.sampled_seq_ids:
            return None
        fb = worker_pb2.SampledFeedback(micro_batch_id=work.mb.micro_batch_id)
        fb.seq_ids.extend(result.sampled_seq_ids)
        fb.positions.extend(result.sampled_positions)
        fb.token_ids.extend(result.sampled.token_ids)
        return fb

    def _compute(self, work: _Work) -> None:
        """Runs on the executor thread: the only place this stage's tensors are touched.
        What the step hands on is encoded here too, off the event loop and before the
        thread hands back: the hidden states into the micro-batch (not last), the sampled
        tokens into the first stage's feedback (last of several)."""
        work.compute_start_ns = time.time_ns()
        self.progress.step_started(work.mb.micro_batch_id)
        try:
            work.result = self.runner.execute(work.plan, received(work.hidden))
        finally:
            self.progress.step_ended()
        work.compute_end_ns = time.time_ns()
        work.hidden = None
        if work.result.hidden is not None and self.data_out is not None:
            work.out_hidden = self.data_out.pack(work.result.hidden, work.mb)
            work.result.hidden = None
        if self.config.feedback_address:
            work.feedback = self._feedback_of(work)

    async def _sender_loop(self) -> None:
        while True:
            work = await self._send_queue.get()
            mb = work.mb
            mb.stage_index = self.config.stage + 1
            try:
                call = await self._ensure_call()
                await self.data_out.place(work.out_hidden, mb)  # a full ring waits here: back-pressure
                work.out_hidden = None
                mb.sent_ns = time.time_ns()
                size = mb.ByteSize()
                if size > self.max_message_bytes:
                    work.error = (
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"micro-batch {mb.micro_batch_id} is {size} bytes, over the {self.max_message_bytes}-byte "
                        "message limit: lower max_num_batched_tokens",
                    )
                else:
                    await call.write(mb)
                    work.forwarded_ns = time.time_ns()
                    self.num_sent_bytes += size + _shared_bytes(mb)
            except Exception as exc:  # noqa: BLE001 - any failure of the stream (or its ring) means the same
                self._drop_call()
                work.out_hidden = None
                work.error = (
                    grpc.StatusCode.UNAVAILABLE,
                    f"next stage at {self.config.next_address} is unavailable: {_describe(exc)}",
                )
            if work.error is not None:
                self._report_forward_failure(work)

    async def _ensure_call(self):
        if self._call is None:
            await asyncio.wait_for(self._channel.channel_ready(), timeout=2.0)
            stub = worker_pb2_grpc.StageWorkerStub(self._channel)
            await self.data_out.connect(stub)  # the channel for hidden states: a ring offered anew
            self._call = stub.Forward()
            self._downstream_task = asyncio.create_task(self._watch_downstream(self._call), name="downstream")
            self.downstream_connected = True
        return self._call

    def _drop_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = None
        self.downstream_connected = False
        self.data_out.drop()

    async def _watch_downstream(self, call) -> None:
        """The stream to the next stage sends nothing back until it ends: its end (an error,
        or the next stage gone) drops it, and the next micro-batch opens another."""
        try:
            await call
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.warning("stream to next stage %s broke: %s", self.config.next_address, _describe(exc))
        except asyncio.CancelledError:
            return
        if self._call is call:
            self._call = None
            self.downstream_connected = False
            self.data_out.drop()

    def _report_forward_failure(self, work: _Work) -> None:
        code, message = work.error
        done = worker_pb2.MicroBatchDone(micro_batch_id=work.mb.micro_batch_id)
        done.error.code = code.value[0]
        done.error.message = message
        self.num_failed += 1
        log.warning("micro-batch %d not handed on: %s %s", work.mb.micro_batch_id, code.name, message)
        self._emit(worker_pb2.StageEvent(stage_index=self.config.stage, epoch=self.epoch, done=done))

    def _finish(self, work: _Work) -> None:
        """Count the step and report it: a failure at once on Events; a success on Events
        from the last stage only, with every stage's timing, which the others append to the
        micro-batch they hand on (MicroBatch.upstream_timings): one event per step for the
        scheduler to read, not one per stage."""
        done = worker_pb2.MicroBatchDone(micro_batch_id=work.mb.micro_batch_id)
        timing = done.timing
        timing.stage_index = self.config.stage
        timing.sent_ns = work.upstream_sent_ns
        timing.received_ns = work.received_ns
        timing.compute_start_ns = work.compute_start_ns
        timing.compute_end_ns = work.compute_end_ns
        timing.forwarded_ns = work.forwarded_ns
        if work.plan is not None:
            timing.num_seqs = work.plan.num_seqs
            timing.num_tokens = work.plan.num_tokens
        if work.error is not None:
            code, message = work.error
            done.error.code = code.value[0]
            done.error.message = message
            self.num_failed += 1
            log.warning("micro-batch %d failed: %s %s", work.mb.micro_batch_id, code.name, message)
        else:
            self.num_micro_batches += 1
            self.num_tokens += timing.num_tokens
            self.busy_ns += work.compute_end_ns - work.compute_start_ns
            copies = len(work.plan.block_copies)
            self.num_block_copies += copies
            done.num_block_copies_applied = copies
            if self._tracing:
                self._trace_spans(work)
            if not self.config.is_last:
                work.mb.upstream_timings.append(timing)
                self.num_in_flight -= 1
                return
            done.upstream_timings.extend(work.mb.upstream_timings)
            if work.result.sampled is not None:
                result_to_pb(work.result.step_result(), done)
        self.num_in_flight -= 1
        self._emit(worker_pb2.StageEvent(stage_index=self.config.stage, epoch=self.epoch, done=done))

    def _trace_spans(self, work: _Work) -> None:
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

    def metric_samples(self):
        """Prometheus samples (services.metrics.Sample) read at scrape time."""
        uptime = time.time_ns() - self.started_ns
        return [
            ("pagoda:stage_busy_seconds", "Seconds this stage spent computing.", "counter", self.busy_ns / 1e9),
            (
                "pagoda:stage_idle_seconds",
                "Seconds this stage was not computing.",
                "counter",
                max(0, uptime - self.busy_ns) / 1e9,
            ),
            ("pagoda:stage_micro_batches", "Micro-batches computed.", "counter", self.num_micro_batches),
            ("pagoda:stage_failed_micro_batches", "Micro-batches failed.", "counter", self.num_failed),
            ("pagoda:stage_tokens", "Tokens computed.", "counter", self.num_tokens),
            ("pagoda:stage_micro_batches_in_flight", "Received, not yet done.", "gauge", self.num_in_flight),
            ("pagoda:stage_block_copies", "KV block copies applied.", "counter", self.num_block_copies),
            ("pagoda:stage_received_bytes", "Bytes received.", "counter", self.num_received_bytes),
            ("pagoda:stage_sent_bytes", "Bytes sent downstream.", "counter", self.num_sent_bytes),
            (
                "pagoda:stage_ring_full_waits",
                "Hand-offs that waited for a free slot of the ring to the next stage (back-pressure).",
                "counter",
                self.data_out.num_full_waits if self.data_out else 0,
            ),
            (
                "pagoda:stage_data_channel_info",
                "How hidden states go to the next stage (issue 37): shm, nccl, gloo or grpc.",
                "gauge",
                1.0,
                {"channel": (self.data_out.channel or "none") if self.data_out else "last"},
            ),
            (
                "pagoda:device_info",
                "The device this stage runs on (emulated:PROFILE: an emulated one, whose compute is a modelled wait).",
                "gauge",
                1.0,
                {"device": self.runner.device_name},
            ),
        ]

    def _emit(self, event: worker_pb2.StageEvent) -> None:
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                log.error("dropping an events subscriber that stopped reading")
                self._subscribers.discard(queue)


def _shared_bytes(mb: worker_pb2.MicroBatch) -> int:
    """The bytes of hidden states that crossed beside the message (a ring's slot, a link)."""
    if not mb.HasField("hidden_ref"):
        return 0
    n = _ITEMSIZE.get(mb.hidden_ref.dtype, 0)
    for d in mb.hidden_ref.shape:
        n *= max(d, 0)
    return n


_ITEMSIZE = {
    common_pb2.DTYPE_FLOAT32: 4,
    common_pb2.DTYPE_FLOAT16: 2,
    common_pb2.DTYPE_BFLOAT16: 2,
    common_pb2.DTYPE_FLOAT8_E4M3FN: 1,
    common_pb2.DTYPE_INT64: 8,
    common_pb2.DTYPE_INT32: 4,
}


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, (DataPlaneError, stage_ring.RingFullError)):
        return str(exc)
    if isinstance(exc, asyncio.TimeoutError):
        return "not reachable within 2 s"
    return f"{type(exc).__name__}: {exc}"


def _load_runner(config: WorkerConfig):
    """(runner, how its pool was sized or None, its tensor-parallel group or None): the stage's
    weights loaded on its device, its KV pool sized and allocated."""
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.device import default_attention_backend, resolve_device
    from worker_svc.execution.memory import kv_pool_dtype, stage_pool
    from worker_svc.kernels.cpu_kernels import keep_freed_memory

    torch.set_num_threads(config.resolved_num_threads)
    keep_freed_memory()
    device = resolve_device(config.device)
    group = None
    if config.tensor_parallel_size > 1:  # ranks 1..T-1 start now and load beside this one
        from worker_svc.execution.tensor_parallel import start_ranks

        group = start_ranks(config, device)
    model = load_stage(
        config.model,
        config.stage,
        config.num_stages,
        config.layer_partition,
        config.dtype,
        device,
        quantization=config.quantization,
        tp_size=config.tensor_parallel_size,
        expert_parallel=config.enable_expert_parallel,
    )
    if group is not None:
        model.set_reduce(group.all_reduce)
    backend = config.attention_backend or default_attention_backend(device)
    layout = model.kv_layout if model.kv_layout.grouped else None  # KV groups: services/kv_layout.py
    if group is not None:
        layout = group.share_layout(layout, model.kv_layout)
    num_blocks, sizing = stage_pool(config, model, backend, group, layout)
    drafter = drafter_for(
        config.speculative_config,
        is_last=config.is_last,
        vocab_size=model.config.vocab_size,
        max_model_len=config.max_model_len or model.config.max_position_embeddings,
        num_blocks=num_blocks,
        block_size=config.block_size,
        dtype=next(model.parameters()).dtype,
        device=device,
        backend=backend,
    )
    lora = bank_for(
        model,
        enable=config.enable_lora,
        modules=lora_modules(config.lora_modules),
        max_loras=config.max_loras,
        max_rank=config.max_lora_rank,
    )
    runner = StageRunner(
        model,
        num_blocks,
        config.block_size,
        backend,
        kv_dtype=kv_pool_dtype(config, model),
        tp=group,
        step_threads=config.step_threads,
        drafter=drafter,
        lora=lora,
        layout=layout,
    )
    return runner, sizing, group


def _emulated_runner(config: WorkerConfig):
    """The stage on an emulated device (worker_svc/execution/emulated.py): config.json only, no weights,
    no KV tensors, no tensor-parallel ranks (the profile models them); one thread, for the
    zeros it hands on and the wire."""
    from worker_svc.execution.emulated import build_emulated_runner

    torch.set_num_threads(1)
    return build_emulated_runner(config)


async def serve(config: WorkerConfig, ready_file: str | None = None, metrics_port: int | None = None) -> None:
    """Load the stage, serve until SIGTERM/SIGINT, then stop cleanly."""
    telemetry.setup_tracing(f"worker-{config.stage}")
    if config.emulated_profile is not None:
        runner, sizing, group = _emulated_runner(config), None, None
    else:
        runner, sizing, group = _load_runner(config)
    model = runner.model
    service = StageService(config, runner)
    service.kv_sizing = sizing
    server, port, health = create_aio_server(config.address, service.max_message_bytes)
    worker_pb2_grpc.add_StageWorkerServicer_to_server(service, server)
    await server.start()
    await service.start()
    await set_serving(health, SERVICE_NAME, True)
    if metrics_port is not None:
        from services.metrics import serve_metrics

        serve_metrics(metrics_port, config.host, service.metric_samples, {"stage": str(config.stage)})
    log.info(
        "stage %d/%d serving layers [%d, %d) on %s:%d, %s, epoch %d, %d threads, %d KV blocks of %d%s",
        config.stage,
        config.num_stages,
        model.start,
        model.end,
        config.host,
        port,
        runner.device_name,
        service.epoch,
        torch.get_num_threads(),
        runner.num_blocks,
        config.block_size,
        f", tensor parallel x{config.tensor_parallel_size}" if group is not None else "",
    )
    stop = asyncio.Event()
    service.on_fatal = stop.set
    await serve_until_signalled(port=port, ready_file=ready_file, stop=stop)
    log.info("stage %d stopping", config.stage)
    await set_serving(health, SERVICE_NAME, False)
    await server.stop(grace=2.0)
    await service.stop()
    if group is not None:
        group.stop()
    if service.fatal is not None:  # not serving any more: exit so that a supervisor restarts it
        raise SystemExit(f"stage {config.stage}: the compute loop died: {service.fatal!r}")
