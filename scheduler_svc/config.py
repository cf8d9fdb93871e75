"""The scheduler's configuration: one frozen dataclass, names as LLM-server users know them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler_svc.core.queue import POLICIES


@dataclass(frozen=True)
class SchedulerConfig:
    model: str = ""
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    # None ("auto"): asynchronous with several stages, synchronous with one. With one stage,
    # two micro-batches in flight split the running sequences and lose to one
    # (`pagoda bench` (b): 0.68x on the 25M model, 0.84-0.99x on the tiny one).
    async_scheduling: bool | None = None
    scheduler_policy: str = "fcfs"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    microbatch_size: str | int = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # checked against the KV service and every stage
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    scheduler_timeout_ms: int = 50
    max_model_len: int = 4096
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    enforce_tenants: bool = False
    aging_rate: float = 0.0
    max_queue_len: int = 10_000
    recovery_timeout_s: float = 60.0
    max_request_failures: int = 3
    trace_file: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size: {self.tensor_parallel_size} is not supported yet "
                "(only pipeline parallelism is built); use pipeline_parallel_size"
            )
        if not 1 <= self.pipeline_parallel_size <= 8:
            raise ValueError(f"pipeline_parallel_size: must be 1..8, got {self.pipeline_parallel_size}")
        if self.scheduler_policy not in POLICIES:
            raise ValueError(f"scheduler_policy: must be one of {', '.join(POLICIES)}, got {self.scheduler_policy!r}")
        if self.preemption_mode != "recompute":
            raise ValueError(f"preemption_mode: only 'recompute' is supported, got {self.preemption_mode!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "scheduler_timeout_ms",
                     "max_model_len", "max_queue_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.microbatch_size != "auto":
            try:
                size = int(self.microbatch_size)
            except (TypeError, ValueError):
                raise ValueError(f"microbatch_size: 'auto' or a positive int, got {self.microbatch_size!r}") from None
            if size < 1:
                raise ValueError(f"microbatch_size: 'auto' or a positive int, got {self.microbatch_size!r}")
            object.__setattr__(self, "microbatch_size", size)
        if any(w <= 0 for w in self.tenant_weights.values()):
            raise ValueError("tenant_weights: weights must be positive")
        if self.aging_rate < 0:
            raise ValueError(f"aging_rate: must be >= 0, got {self.aging_rate}")

    @property
    def is_async(self) -> bool:
        """Whether scheduling is asynchronous: as set, else with more than one stage."""
        if self.async_scheduling is None:
            return self.pipeline_parallel_size > 1
        return self.async_scheduling

    @property
    def max_in_flight(self) -> int:
        """Micro-batches in the pipeline at once: one per stage when asynchronous, else one."""
        if not self.is_async:
            return 1
        return max(2, self.pipeline_parallel_size)
