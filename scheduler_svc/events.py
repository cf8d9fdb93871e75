"""What the engine talks to, and what comes back: the stages' transport and the KV client
(their protocols), and the events a transport reports (`StageInfo` when a stage's stream
opens, a step's error, a stage gone down, the stages' answer about a late step); whether the
stages that connected fit the scheduler's configuration (`check_stages`).

Transports carry micro-batches to the stages over gRPC (`scheduler_svc.transport`) or to
in-process stage runners (`wiring.local_engine`); the engine (`scheduler_svc.engine`) is the
same for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from scheduler_svc.config import SchedulerConfig
from services.kv_layout import parse_spec
from services.kv_types import StepOutput
from services.step import StepPlan


@dataclass(frozen=True)
class StageInfo:
    """A stage as it reported itself (LoadInfo) when its event stream opened."""

    stage_index: int
    num_stages: int
    epoch: int
    layer_start: int
    layer_end: int
    num_layers: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    address: str = ""
    # the first stage gets each sampled token straight from the last (several stages): the
    # plans carry no tokens and placeholder steps work at any pipeline size
    feedback: bool = False
    weights_bytes: int = 0  # the stage's weights as held (packed formats at their packed size)
    expert_weights_bytes: int = 0  # of those, the experts of mixture-of-experts layers
    quantization: str = ""  # its weight format when not plain ("fp8", "gguf:Q4_1/Q8_0", ...)
    kv_block_bytes: int = 0  # one KV block over the stage's layers, at its pools' dtype
    kv_cache_dtype: int = 0  # the pools' dtype (common_pb2.DType)
    memory_budget_bytes: int = 0  # the memory setting's budget when the pool was sized from one
    kv_groups: str = ""  # its KV layout's sub-group windows (services/kv_layout.py), "" for one table
    device: str = ""  # "cpu", "cuda:0", or "emulated:PROFILE" (its compute a modelled wait)
    cpu: str = ""  # on the CPU: its model, ISA level and the path each product takes


@dataclass(frozen=True)
class ErrorEvent:
    micro_batch_id: int
    stage_index: int
    code: str  # a grpc.StatusCode name
    message: str


@dataclass(frozen=True)
class ProgressReport:
    """The stages' answer about a step past its deadline: `working` when every stage
    answered and each one computing ticked within the base timeout."""

    micro_batch_id: int
    working: bool
    detail: str
    computing: tuple[int, ...] = ()  # the micro-batches the stages said they compute


@dataclass(frozen=True)
class StageDownEvent:
    stage_index: int
    message: str


class StageTransport(Protocol):
    """Carries micro-batches down the pipeline and reports results as events."""

    async def connect(self, on_event: Callable[[object], None], timeout_s: float) -> list[StageInfo]:
        """(Re)connect to every stage; returns their LoadInfo once all are ready."""

    async def submit(self, plan: StepPlan) -> None:
        """Send a step down the pipeline; its StepResult (or ErrorEvent) comes back as an event."""

    async def abandon(self, seq_ids: list[int]) -> None:
        """With feedback: tell the first stage these sequences' awaited tokens will not come."""

    async def stage_stats(self, timeout_s: float = 1.0) -> list[dict]: ...

    async def close(self) -> None: ...


class KVClient(Protocol):
    async def step(self, step_input) -> StepOutput: ...

    async def reset(self) -> None: ...

    async def stats(self): ...


def check_stages(stages: list[StageInfo], config: SchedulerConfig) -> None:
    """One source of capacity: every stage must agree with the KV service and the config.
    Raises ValueError naming the first stage that does not."""
    for info in stages:
        # a stage may hold more blocks than the pool uses (pools sized from memory: the
        # smallest stage's is the pool), never fewer
        if info.block_size != config.block_size or (
            config.num_kv_blocks is not None and info.num_kv_blocks < config.num_kv_blocks
        ):
            raise ValueError(
                f"stage {info.stage_index} has {info.num_kv_blocks} KV blocks of {info.block_size}; "
                f"the scheduler and KV service use {config.num_kv_blocks} of {config.block_size}"
            )
        if info.num_stages != len(stages):
            raise ValueError(f"stage {info.stage_index} was started as one of {info.num_stages} stages")
        if parse_spec(info.kv_groups) != parse_spec(config.kv_groups):
            raise ValueError(
                f"stage {info.stage_index} keeps KV groups {info.kv_groups or 'none'} "
                f"(services/kv_layout.py), the KV service {config.kv_groups or 'none'}"
            )
