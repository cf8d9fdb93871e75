"""The scheduler's configuration: one frozen dataclass, names as LLM-server users know them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields

from scheduler_svc.core.queue import POLICIES
from services.defaults import BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, NUM_KV_BLOCKS

SAME = object()  # EngineArg.cli_default: the field's own default


@dataclass(frozen=True)
class EngineArg:
    """How an engine setting appears on the command line (vLLM's EngineArgs, in one place).

    `pagoda scheduler` and `pagoda serve` get a `--kebab-case` flag per field that carries
    one, with a `PAGODA_<NAME>` environment default; `pagoda serve` passes the same flags on
    to its scheduler. `kind`: "int", "float", "str", "bool" (--x / --no-x), "auto_bool"
    (--x / --no-x, unset = auto), "switch" (--x only), "weights" (a=3,b=1).
    """

    help: str
    kind: str = "int"
    choices: tuple[str, ...] | None = None
    cli_default: object = SAME  # the flag's default when it differs from the field's
    passed_by_serve: bool = True  # `pagoda serve` passes it on (else it sets it itself)


def _arg(default, help: str, kind: str = "int", **kw):
    meta = {"engine_arg": EngineArg(help, kind, **kw)}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class SchedulerConfig:
    model: str = ""
    pipeline_parallel_size: int = _arg(1, "pipeline stages (1..8)", passed_by_serve=False)
    # None ("auto"): asynchronous. With one stage, a decoding sequence's next step is planned
    # before its token is known (placeholder steps, docs/step-protocol.md): `pagoda serve`
    # 1.13x the output tok/s and 0.69x the latency of synchronous (bench/vs_vllm.py)
    async_scheduling: bool | None = _arg(
        None, "plan the next step while one runs (default: on; see docs/step-protocol.md)", "auto_bool")
    scheduler_policy: str = _arg("fcfs", "waiting-queue order", "str", choices=POLICIES)
    max_num_batched_tokens: int = _arg(MAX_NUM_BATCHED_TOKENS, "most tokens in one step")
    max_num_seqs: int = _arg(256, "most sequences running at once")
    microbatch_size: str | int = _arg("auto", "sequences per micro-batch: auto or a number", "str")
    block_size: int = _arg(BLOCK_SIZE, "KV slots per block", passed_by_serve=False)
    # None: not checked against the KV service and the stages
    num_kv_blocks: int | None = _arg(
        None, "KV blocks (default: the KV service's; `pagoda serve`: sized from "
              f"--gpu-memory-utilization or --kv-cache-memory when given, else {NUM_KV_BLOCKS})",
        cli_default=None, passed_by_serve=False)
    enable_chunked_prefill: bool = _arg(True, "split long prompts over steps", "bool")
    enable_prefix_caching: bool = _arg(True, "share KV blocks of common prefixes", "bool")
    preemption_mode: str = _arg("recompute", "how a request gives its KV back", "str", choices=("recompute",))
    scheduler_timeout_ms: int = _arg(50, "longest idle wait of the scheduler loop")
    max_model_len: int = _arg(MAX_MODEL_LEN, "longest context (default: the model's max_position_embeddings)",
                              cli_default=None)
    tenant_weights: Mapping[str, float] = _arg({}, "weighted fair queuing, e.g. a=3,b=1", "weights")
    enforce_tenants: bool = _arg(False, "refuse requests of tenants without a weight", "switch")
    aging_rate: float = _arg(0.0, "priority gained per second of waiting", "float")
    max_queue_len: int = _arg(10_000, "most requests waiting")
    recovery_timeout_s: float = _arg(60.0, "how long requests wait for a failed pipeline", "float")
    step_timeout_s: float = _arg(60.0, "a micro-batch still in flight after this long means a hung stage: "
                                       "the pipeline is reset and recovered as after a failure", "float")
    max_request_failures: int = 3
    trace_file: str | None = None

    def __post_init__(self) -> None:
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
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: must be positive, got {self.step_timeout_s}")
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
        """Whether scheduling is asynchronous: as set, else yes."""
        if self.async_scheduling is None:
            return True
        return self.async_scheduling

    @property
    def max_in_flight(self) -> int:
        """Micro-batches in the pipeline at once: one per stage when asynchronous, else one."""
        if not self.is_async:
            return 1
        return max(2, self.pipeline_parallel_size)


def engine_args() -> list[tuple[str, EngineArg, object]]:
    """(field name, how it appears on the command line, the flag's default), in field order."""
    out = []
    for f in fields(SchedulerConfig):
        arg = f.metadata.get("engine_arg")
        if arg is None:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        out.append((f.name, arg, default if arg.cli_default is SAME else arg.cli_default))
    return out


def kv_capacity_line(num_blocks: int, block_size: int, max_model_len: int) -> str:
    """What the pool holds, as vLLM logs it at start."""
    tokens = num_blocks * block_size
    return (f"KV cache: {num_blocks} blocks, {tokens} tokens, max concurrency "
            f"{tokens / max_model_len:.2f}x at max_model_len {max_model_len}")
