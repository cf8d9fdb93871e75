"""A stage's counters: written by the compute loop and the sender, read by `GetStats`, the
scheduler's `LoadInfo` and `/metrics`."""

from __future__ import annotations

import threading
import time

from services.pb import worker_pb2
from worker_svc.execution.data_plane import DataPlaneIn, DataPlaneOut
from worker_svc.execution.progress import StageProgress
from worker_svc.kernels.calibrate import describe_cpu
from worker_svc.service.feedback import FeedbackInbox
from worker_svc.service.work import shared_bytes


class StageStatistics:
    def __init__(
        self,
        stage: int,
        epoch: int,
        device_name: str,
        progress: StageProgress,
        inbox: FeedbackInbox,
        data_in: DataPlaneIn,
        data_out: DataPlaneOut | None,
    ) -> None:
        self.stage, self.epoch, self.device_name = stage, epoch, device_name
        self.progress, self.inbox, self.data_in, self.data_out = progress, inbox, data_in, data_out
        self.started_ns = time.time_ns()
        self._lock = threading.Lock()  # the counts written by both the event loop and the step thread
        self.cpu = describe_cpu(device_name)
        self.busy_ns = 0
        self.num_micro_batches = 0
        self.num_failed = 0
        self.num_tokens = 0
        self.num_in_flight = 0
        self.peak_in_flight = 0
        self.num_block_copies = 0
        self.num_received_bytes = 0
        self.num_sent_bytes = 0
        self.control_channel = ""  # how step messages go on: "unix" or "grpc" (downstream.py, feedback.py)
        self.listener = None  # the local socket (services/local_stream.py), when the stage has one
        # P/D disaggregation's KV transfer (service/kv_transfer.py); on /metrics only
        self.num_exported_blocks = self.num_exported_bytes = 0
        self.num_imported_blocks = self.num_imported_bytes = 0

    def received(self, mb: worker_pb2.MicroBatch) -> None:
        size = mb.ByteSize() + shared_bytes(mb)  # the message, and what it refers to
        with self._lock:
            self.num_received_bytes += size
            self.num_in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.num_in_flight)

    def finished(self, num_tokens: int = 0, busy_ns: int = 0, num_block_copies: int = 0, failed: bool = False) -> None:
        """A received micro-batch is done (on the event loop, or on the step thread for a step
        handed on: hence the lock)."""
        with self._lock:
            self.num_in_flight = max(0, self.num_in_flight - 1)
            if failed:
                self.num_failed += 1
                return
            self.num_micro_batches += 1
            self.num_tokens += num_tokens
            self.busy_ns += busy_ns
            self.num_block_copies += num_block_copies

    def exported(self, num_bytes: int) -> None:
        self.num_exported_blocks += 1
        self.num_exported_bytes += num_bytes

    def imported(self, num_blocks: int, num_bytes: int) -> None:
        self.num_imported_blocks += num_blocks
        self.num_imported_bytes += num_bytes

    def stats(self) -> worker_pb2.StageStats:
        uptime, out, inbox, progress = time.time_ns() - self.started_ns, self.data_out, self.inbox, self.progress
        return worker_pb2.StageStats(
            stage_index=self.stage,
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
            num_fed_tokens=inbox.num_fed_tokens,
            num_feedback_waits=inbox.num_feedback_waits,
            num_abandoned=inbox.num_abandoned,
            num_progress_ticks=progress.num_ticks,
            progress_age_ns=progress.age_ns(),
            computing_micro_batch_id=progress.micro_batch_id,
            cpu=self.cpu,
            uptime_ns=uptime,
            data_channel=out.channel if out else "",
            upstream_channel=self.data_in.channel,
            num_ring_full_waits=out.num_full_waits if out else 0,
            num_shm_sent=out.num_shm_sent if out else 0,
            num_grpc_sent=out.num_grpc_sent if out else 0,
            num_p2p_sent=out.num_p2p_sent if out else 0,
            control_channel=self.control_channel,
            num_local_streams=self.listener.num_open if self.listener else 0,
        )

    def metric_samples(self):
        """Prometheus samples (services.metrics.Sample) read at scrape time."""
        uptime, out = time.time_ns() - self.started_ns, self.data_out
        idle_s = max(0, uptime - self.busy_ns) / 1e9
        return [
            ("pagoda:stage_busy_seconds", "Seconds this stage spent computing.", "counter", self.busy_ns / 1e9),
            ("pagoda:stage_idle_seconds", "Seconds this stage was not computing.", "counter", idle_s),
            ("pagoda:stage_micro_batches", "Micro-batches computed.", "counter", self.num_micro_batches),
            ("pagoda:stage_failed_micro_batches", "Micro-batches failed.", "counter", self.num_failed),
            ("pagoda:stage_tokens", "Tokens computed.", "counter", self.num_tokens),
            ("pagoda:stage_micro_batches_in_flight", "Received, not yet done.", "gauge", self.num_in_flight),
            ("pagoda:stage_block_copies", "KV block copies applied.", "counter", self.num_block_copies),
            ("pagoda:stage_received_bytes", "Bytes received.", "counter", self.num_received_bytes),
            ("pagoda:stage_sent_bytes", "Bytes sent downstream.", "counter", self.num_sent_bytes),
            ("pagoda:stage_kv_exported_blocks", "KV blocks exported (P/D).", "counter", self.num_exported_blocks),
            ("pagoda:stage_kv_exported_bytes", "KV bytes exported (P/D).", "counter", self.num_exported_bytes),
            ("pagoda:stage_kv_imported_blocks", "KV blocks pulled (P/D).", "counter", self.num_imported_blocks),
            ("pagoda:stage_kv_imported_bytes", "KV bytes pulled (P/D).", "counter", self.num_imported_bytes),
            (
                "pagoda:stage_ring_full_waits",
                "Hand-offs that waited for a free slot of the ring to the next stage (back-pressure).",
                "counter",
                out.num_full_waits if out else 0,
            ),
            (
                "pagoda:stage_data_channel_info",
                "How hidden states go to the next stage (issue 37): shm, nccl, gloo or grpc.",
                "gauge",
                1.0,
                {"channel": (out.channel or "none") if out else "last"},
            ),
            (
                "pagoda:device_info",
                "The device this stage runs on (emulated:PROFILE: an emulated one, whose compute is a modelled wait).",
                "gauge",
                1.0,
                {"device": self.device_name},
            ),
        ]
