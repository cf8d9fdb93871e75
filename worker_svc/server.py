"""The stage worker as a gRPC service (`pagoda.v1.StageWorker`): a thin servicer over the stage's
parts (worker_svc/service/).

Data flows down the chain only: the upstream side (the scheduler for stage 0, stage K for
stage K+1) opens one long-lived `Forward` stream of micro-batches; results go straight back
on `Events` streams that the scheduler holds from every stage.

Inside a stage three things overlap, each with one owner:
- the `Forward` handler (event loop) receives and decodes the next micro-batch
  (`ComputeLoop.accept`),
- the compute loop (`service/compute.py`) runs plans in arrival order on the step thread,
- the sender (`service/downstream.py`, not on the last stage) hands hidden states downstream
  while the next micro-batch computes.
With several stages started with `--feedback` (on the last), the last stage streams each
step's sampled tokens straight to the first (`service/feedback.py`), whose steps wait for them.
LoRA administration (`service/lora_admin.py`) runs between steps on the compute thread;
P/D disaggregation's KV transfer (`ExportBlocks`, `PullBlocks`) is `service/kv_transfer.py`;
the counters live in `service/statistics.py`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import grpc
import torch

from services import local_stream, telemetry
from services.grpc_utils import create_aio_server, drain_requests, serve_until_signalled, set_serving
from services.pb import common_pb2, worker_pb2, worker_pb2_grpc
from worker_svc.checkpoints.convert import dtype_to_pb
from worker_svc.config import WorkerConfig
from worker_svc.execution import stage_ring
from worker_svc.execution.data_plane import DataPlaneIn, DataPlaneOut
from worker_svc.execution.progress import StageProgress
from worker_svc.models.stage import StageModel
from worker_svc.service.compute import ComputeLoop
from worker_svc.service.downstream import Downstream
from worker_svc.service.feedback import FeedbackInbox, FeedbackOutbox
from worker_svc.service.kv_transfer import KVTransfer
from worker_svc.service.loading import emulated_runner, load_runner
from worker_svc.service.lora_admin import LoraAdmin
from worker_svc.service.statistics import StageStatistics

log = logging.getLogger(__name__)
SERVICE_NAME = "pagoda.v1.StageWorker"


class StageService(worker_pb2_grpc.StageWorkerServicer):
    def __init__(self, config: WorkerConfig, runner) -> None:
        self.config = config
        self.runner = runner
        self.kv_sizing = None  # worker_svc.execution.memory.KVSizing when the pool was sized from memory
        self.epoch = secrets.randbits(63) | 1  # a new id per process start; never 0
        self.max_message_bytes = config.max_message_bytes(runner.model.config.hidden_size)
        self._subscribers: set[asyncio.Queue] = set()
        self._tasks: list[asyncio.Task] = []
        # the data plane (worker_svc/execution/data_plane.py): hidden states to the next stage and from the previous
        hidden_size, device = runner.model.config.hidden_size, getattr(runner, "device", "cpu")
        self.data_out = None
        if not config.is_last:
            slot_bytes = stage_ring.slot_bytes_for(config.max_num_batched_tokens, hidden_size)
            self.data_out = DataPlaneOut(
                config.stage_channel, config.stage, slot_bytes, device=device, host=config.host
            )
        self.data_in = DataPlaneIn(config.stage_channel, device)
        self.inbox = FeedbackInbox()  # the first stage's tokens fed by the last
        # ticks of the compute thread (per layer): a slow step from a hung stage
        progress = StageProgress()
        if isinstance(getattr(runner, "model", None), StageModel):
            runner.model.on_layer = progress.tick
        self.stats = StageStatistics(
            config.stage, self.epoch, runner.device_name, progress, self.inbox, self.data_in, self.data_out
        )
        self.compute = ComputeLoop(config, runner, self.stats, self.inbox, self.data_in, self.data_out, self._emit)
        if self.data_out is not None:
            self.compute.downstream = Downstream(
                config.stage,
                config.next_address,
                self.data_out,
                self.max_message_bytes,
                self.stats,
                self.compute.report_forward_failure,
            )
        if config.feedback_address:
            self.compute.outbox = FeedbackOutbox(
                config.feedback_address, self.max_message_bytes, self.stats, local=config.stage_channel != "grpc"
            )
        # the step's streams on this host (services/local_stream.py), unless set to gRPC only
        self.listener = None
        if config.stage_channel != "grpc":
            self.listener = local_stream.LocalListener(
                {"Forward": self._local_forward, "Feedback": self._local_feedback, "Events": self._local_events},
                self.max_message_bytes,
            )
            self.stats.listener = self.listener
        self.lora = LoraAdmin(runner, self.compute.executor)
        self.kv_transfer = KVTransfer(runner, self.compute.executor, self.stats, self.max_message_bytes)

    @property
    def fatal(self) -> BaseException | None:
        """Why the compute loop ended, if it did (the process exits, to be restarted)."""
        return self.compute.fatal

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if self.listener is not None:
            await self.listener.start()
        self._tasks.append(asyncio.create_task(self.compute.run(), name="compute"))
        if self.compute.downstream is not None:
            self._tasks.append(self.compute.downstream.start())
        if self.compute.outbox is not None:
            self._tasks.append(self.compute.outbox.start())

    async def stop(self) -> None:
        if self.listener is not None:
            await self.listener.close()
        for task in self._tasks:
            task.cancel()
        if self.compute.downstream is not None:
            await self.compute.downstream.stop()
        if self.compute.outbox is not None:
            await self.compute.outbox.stop()
        self.compute.executor.shutdown(wait=False, cancel_futures=True)
        if getattr(self.runner, "kv_tier", None) is not None:
            self.runner.kv_tier.close()  # its files go with it

    # --- rpcs --------------------------------------------------------------------------

    async def Forward(self, request_iterator, context):
        count = 0
        async for mb in request_iterator:
            count += 1
            await self.compute.accept(mb)
        return worker_pb2.ForwardSummary(num_micro_batches=count)

    async def Feedback(self, request_iterator, context):
        """The last stage's sampled tokens (first stage): applied between steps."""
        if not self.config.is_first or self.config.is_last:
            await drain_requests(request_iterator)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "only the first stage of several takes sampled-token feedback"
            )
        self.inbox.stream_opened()
        log.info("feedback stream from %s connected", context.peer())
        try:
            async for fb in request_iterator:
                if len(fb.seq_ids) != len(fb.positions) or len(fb.seq_ids) != len(fb.token_ids):
                    await drain_requests(request_iterator)
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"feedback of step {fb.micro_batch_id}: columns of unequal length",
                    )
                self.inbox.add(fb)
        finally:
            self.inbox.stream_closed()
        return worker_pb2.FeedbackAck()

    async def Abandon(self, request, context):
        if request.epoch in (0, self.epoch):
            self.inbox.abandon(request.seq_ids)
        return worker_pb2.AbandonReply()

    async def LoadLoraAdapter(self, request, context):
        return await self.lora.call(context, "load", request.lora_name, request.lora_path, request.load_id)

    async def UnloadLoraAdapter(self, request, context):
        return await self.lora.call(context, "unload", request.lora_name, "")

    async def ExportBlocks(self, request, context):
        async for chunk in self.kv_transfer.export(request, context):
            yield chunk

    async def PullBlocks(self, request, context):
        return await self.kv_transfer.pull(request, context)

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

    # the same three streams on the local socket (services/local_stream.py)

    async def _local_forward(self, stream: local_stream.ServerStream) -> None:
        await self.Forward(stream.messages(worker_pb2.MicroBatch), stream.context)

    async def _local_feedback(self, stream: local_stream.ServerStream) -> None:
        await self.Feedback(stream.messages(worker_pb2.SampledFeedback), stream.context)

    async def _local_events(self, stream: local_stream.ServerStream) -> None:
        await stream.respond(worker_pb2.EventsRequest, self.Events)

    async def OpenDataPlane(self, request, context):
        if self.config.is_first:
            return worker_pb2.DataPlaneReply(
                channel=worker_pb2.DATA_CHANNEL_GRPC, reason="the first stage takes no hidden states"
            )
        return await self.data_in.accept(request)

    async def LoadInfo(self, request, context):
        return self.load_info()

    async def GetStats(self, request, context):
        return self.stats.stats()

    async def Health(self, request, context):
        downstream = self.compute.downstream
        return worker_pb2.StageHealth(
            status=common_pb2.HEALTH_STATUS_NOT_SERVING if self.fatal else common_pb2.HEALTH_STATUS_SERVING,
            stage_index=self.config.stage,
            epoch=self.epoch,
            downstream_connected=downstream is None or downstream.connected,
            device=self.runner.device_name,
        )

    # --- views -------------------------------------------------------------------------

    def load_info(self) -> worker_pb2.StageLoadInfo:
        model, cfg, runner, sizing = self.runner.model, self.config, self.runner, self.kv_sizing
        return worker_pb2.StageLoadInfo(
            stage_index=cfg.stage,
            num_stages=cfg.num_stages,
            layer_start=model.start,
            layer_end=model.end,
            num_layers=model.config.num_layers,
            num_kv_blocks=runner.num_blocks,
            block_size=runner.block_size,
            dtype=dtype_to_pb(runner.dtype),
            kv_cache_dtype=dtype_to_pb(runner.kv_dtype),
            model=cfg.model,
            epoch=self.epoch,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            hidden_size=model.config.hidden_size,
            vocab_size=model.config.vocab_size,
            max_message_bytes=self.max_message_bytes,
            next_address=cfg.next_address or "",
            num_threads=torch.get_num_threads(),
            device=runner.device_name,
            quantization=model.weight_format or cfg.quantization,
            feedback_address=cfg.feedback_address or "",
            feedback_connected=self.inbox.num_streams > 0,
            kv_block_bytes=runner.kv_block_bytes,
            memory_total_bytes=sizing.total_bytes if sizing else 0,
            memory_budget_bytes=sizing.budget_bytes if sizing else 0,
            memory_baseline_bytes=sizing.baseline_bytes if sizing else 0,
            weights_bytes=sizing.weights_bytes if sizing else runner.weights_bytes,  # packed rows at packed size
            activation_peak_bytes=sizing.activation_bytes if sizing else 0,
            expert_weights_bytes=runner.expert_weights_bytes,
            tensor_parallel_size=cfg.tensor_parallel_size,
            lora_adapters=self.lora.adapters(),
            cpu=self.stats.cpu,
            kv_groups=model.config.kv_layout.spec(),
            data_channel=self.data_out.channel if self.data_out else "",
            local_socket=self.listener.address if self.listener else "",
            local_token=self.listener.token if self.listener else b"",
        )

    def _emit(self, done: worker_pb2.MicroBatchDone) -> None:
        event = worker_pb2.StageEvent(stage_index=self.config.stage, epoch=self.epoch, done=done)
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                log.error("dropping an events subscriber that stopped reading")
                self._subscribers.discard(queue)


async def serve(config: WorkerConfig, ready_file: str | None = None, metrics_port: int | None = None) -> None:
    """Load the stage, serve until SIGTERM/SIGINT, then stop cleanly."""
    telemetry.setup_tracing(f"worker-{config.stage}")
    if config.emulated_profile is not None:
        runner, sizing, group = emulated_runner(config), None, None
    else:
        runner, sizing, group = load_runner(config)
    model = runner.model
    service = StageService(config, runner)
    service.kv_sizing = sizing
    server, port, health = create_aio_server(config.address, service.max_message_bytes)
    worker_pb2_grpc.add_StageWorkerServicer_to_server(service, server)
    await service.start()  # (its local socket listens before LoadInfo can name it)
    await server.start()
    await set_serving(health, SERVICE_NAME, True)
    if metrics_port is not None:
        from services.metrics import serve_metrics

        serve_metrics(metrics_port, config.host, service.stats.metric_samples, {"stage": str(config.stage)})
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
    service.compute.on_fatal = stop.set
    await serve_until_signalled(port=port, ready_file=ready_file, stop=stop)
    log.info("stage %d stopping", config.stage)
    await set_serving(health, SERVICE_NAME, False)
    await server.stop(grace=2.0)
    await service.stop()
    if group is not None:
        group.stop()
    if service.fatal is not None:  # not serving any more: exit so that a supervisor restarts it
        raise SystemExit(f"stage {config.stage}: the compute loop died: {service.fatal!r}")
