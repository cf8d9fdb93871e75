"""One micro-batch on its way through a stage, and what the stage's parts share about the wire."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from services.pb import common_pb2, worker_pb2
from services.step import StepPlan
from worker_svc.execution import stage_ring
from worker_svc.execution.data_plane import DataPlaneError
from worker_svc.execution.runner import StageResult


@dataclass
class Work:
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


def failed_done(micro_batch_id: int, code: grpc.StatusCode, message: str) -> worker_pb2.MicroBatchDone:
    """The report of a micro-batch that failed at this stage."""
    done = worker_pb2.MicroBatchDone(micro_batch_id=micro_batch_id)
    done.error.code = code.value[0]
    done.error.message = message
    return done


def shared_bytes(mb: worker_pb2.MicroBatch) -> int:
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


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, (DataPlaneError, stage_ring.RingFullError)):
        return str(exc)
    if isinstance(exc, asyncio.TimeoutError):
        return "not reachable within 2 s"
    return f"{type(exc).__name__}: {exc}"
