"""The scheduler's configuration: one frozen dataclass, names as LLM-server users know them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

from scheduler_svc.core.planner_config import parse_microbatch_size
from scheduler_svc.core.queue import POLICIES
from services import settings as shared
from services.defaults import MAX_MODEL_LEN
from services.kv_layout import entries_that_fit, parse_spec
from services.settings import Setting, uses
from services.speculative import SpeculativeConfig


def _arg(default, help: str, kind: str = "int", **kw):
    """An engine setting of the scheduler's own (vLLM's EngineArgs): `pagoda scheduler` and
    `pagoda serve` take its flag, and serve passes a changed value on to its scheduler."""
    return shared.declare("scheduler", default, help, kind, serve="pass", **{"group": "scheduler", **kw})


_process = partial(Setting, owner="scheduler", services=("scheduler",), group="network")


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine settings. Each field that is a setting carries its declaration
    (services/settings.py): the flags, their PAGODA_* variables and what `pagoda serve` passes
    on are made from it."""

    model: str = uses(shared.MODEL, "")
    pipeline_parallel_size: int = uses(shared.PIPELINE_PARALLEL_SIZE)
    # None ("auto"): asynchronous. With one stage, a decoding sequence's next step is planned
    # before its token is known (placeholder steps, docs/step-protocol.md): `pagoda serve`
    # 1.13x the output tok/s and 0.69x the latency of synchronous (bench/vs_vllm.py)
    async_scheduling: bool | None = _arg(
        None, "plan the next step while one runs (default: on; see docs/step-protocol.md)", "auto_bool"
    )
    scheduler_policy: str = _arg("fcfs", "waiting-queue order", "str", choices=POLICIES)
    max_num_batched_tokens: int = uses(shared.MAX_NUM_BATCHED_TOKENS)
    max_num_seqs: int = uses(shared.MAX_NUM_SEQS)
    microbatch_size: str | int = _arg("auto", "sequences per micro-batch: auto or a number", "str")
    block_size: int = uses(shared.BLOCK_SIZE)
    # None: not checked against the KV service and the stages
    num_kv_blocks: int | None = uses(shared.NUM_KV_BLOCKS)
    enable_chunked_prefill: bool = _arg(True, "split long prompts over steps", "bool")
    enable_prefix_caching: bool = uses(shared.ENABLE_PREFIX_CACHING)
    kv_offload: str = uses(shared.KV_OFFLOAD)
    kv_groups: str = uses(shared.KV_GROUPS)  # the KV service's, when not given
    preemption_mode: str = _arg("recompute", "how a request gives its KV back", "str", choices=("recompute",))
    scheduler_timeout_ms: int = _arg(50, "longest idle wait of the scheduler loop")
    # the flag unset: the checkpoint's max_position_embeddings (wiring); this default in code
    max_model_len: int = uses(shared.MAX_MODEL_LEN, MAX_MODEL_LEN)
    tenant_weights: Mapping[str, float] = _arg({}, "weighted fair queuing, e.g. a=3,b=1", "weights")
    enforce_tenants: bool = _arg(False, "refuse requests of tenants without a weight", "switch")
    aging_rate: float = _arg(0.0, "priority gained per second of waiting", "float")
    max_queue_len: int = _arg(10_000, "most requests waiting")
    recovery_timeout_s: float = _arg(60.0, "how long requests wait for a failed pipeline", "float")
    step_timeout_s: float = _arg(
        60.0,
        "a micro-batch still in flight after this long means a hung stage: "
        "the pipeline is reset and recovered as after a failure",
        "float",
    )
    speculative_config: str | None = uses(shared.SPECULATIVE_CONFIG)
    # the gateway's GenerateStream (services/local_stream.py)
    request_channel: str = _arg(
        "auto",
        "how a gateway's request stream reaches this scheduler: auto (a local socket offered to a "
        "gateway on this host, gRPC from elsewhere) or grpc (gRPC only)",
        "str",
        choices=("auto", "grpc"),
        group="network",
    )
    max_request_failures: int = 3
    trace_file: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.pipeline_parallel_size <= 8:
            raise ValueError(f"pipeline_parallel_size: must be 1..8, got {self.pipeline_parallel_size}")
        if self.scheduler_policy not in POLICIES:
            raise ValueError(f"scheduler_policy: must be one of {', '.join(POLICIES)}, got {self.scheduler_policy!r}")
        if self.preemption_mode != "recompute":
            raise ValueError(f"preemption_mode: only 'recompute' is supported, got {self.preemption_mode!r}")
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "block_size",
            "scheduler_timeout_ms",
            "max_model_len",
            "max_queue_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: must be positive, got {self.step_timeout_s}")
        object.__setattr__(self, "microbatch_size", parse_microbatch_size(self.microbatch_size))
        if any(w <= 0 for w in self.tenant_weights.values()):
            raise ValueError("tenant_weights: weights must be positive")
        if self.aging_rate < 0:
            raise ValueError(f"aging_rate: must be >= 0, got {self.aging_rate}")
        self.speculative  # noqa: B018 (refused at start, not at the first request)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

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


# what `pagoda scheduler` takes besides the engine settings: where it listens, where the KV
# service and the stages are, where it reports
KVCACHE = _process(
    "kvcache", "HOST:PORT of the KV-cache service, or 'in-process' to embed the KV manager", required=True
)
STAGES = _process("stages", "HOST:PORT of every stage worker, in order, comma-separated", required=True)
SETTINGS = shared.settings_of(
    SchedulerConfig,
    shared.HOST,
    shared.PORT,
    KVCACHE,
    STAGES,
    shared.METRICS_PORT,
    shared.READY_FILE,
    shared.INTERNAL_TOKEN,
)


def kv_capacity_line(
    num_blocks: int, block_size: int, max_model_len: int, kv_groups: str = "", chunk_tokens: int = 0
) -> str:
    """What the pool holds, as vLLM logs it at start; with KV groups (services/kv_layout.py)
    its pages, and the longest context one sequence can hold (its sliding sub-groups holding
    their window, one prefill chunk of `chunk_tokens` at a time)."""
    if kv_groups:
        windows = parse_spec(kv_groups)
        longest = entries_that_fit(num_blocks, windows, block_size, chunk_tokens) * block_size
        return (
            f"KV cache: {num_blocks} pages in {len(windows)} KV groups (windows {kv_groups}), up to "
            f"{longest} tokens for one sequence; max_model_len {max_model_len}"
        )
    tokens = num_blocks * block_size
    return (
        f"KV cache: {num_blocks} blocks, {tokens} tokens, max concurrency "
        f"{tokens / max_model_len:.2f}x at max_model_len {max_model_len}"
    )
