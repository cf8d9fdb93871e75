"""What a run measured: per-request records, latency percentiles, and service counters.

Pure: no torch, no grpc, no asyncio. Times are `time.perf_counter()` seconds of the load
generator's process; service counters come as `ServiceSnapshot`s, read before and after a
run (from the scheduler's GetStats, or from the in-process engine), and their differences
say what the services did during the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float, method: str = "linear") -> float | None:
    """The q-th percentile (0..100) of `values`; None for no values. `linear` interpolates
    between order statistics (numpy's default); `nearest-rank` is the smallest value with at
    least q% of the values at or below it (always one of the values)."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    if method == "nearest-rank":
        return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]
    if method != "linear":
        raise ValueError(f"method: 'linear' or 'nearest-rank', got {method!r}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles of one latency, in milliseconds; None where there were no samples."""

    count: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencySummary:
        ms = [s * 1000 for s in seconds]
        p = {q: percentile(ms, q) for q in PERCENTILES}
        return cls(len(ms), (sum(ms) / len(ms)) if ms else None, p[50], p[90], p[99])


@dataclass
class RequestRecord:
    """One request as the client saw it: when it was sent, when each chunk of tokens came.

    `chunk_times` holds one time per streamed chunk that carried tokens; `num_output_tokens`
    is what the server reported (usage) or counted. Inter-token latencies are the gaps
    between successive chunks, as vLLM's benchmark measures them.
    """

    index: int
    kind: str
    num_prompt_tokens: int
    max_tokens: int
    sent_s: float
    chunk_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    done_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None

    @property
    def ttft_s(self) -> float | None:
        return (self.chunk_times[0] - self.sent_s) if self.chunk_times else None

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def latency_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (latency - TTFT) / (tokens - 1)."""
        if self.done_s is None or self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class ClientMetrics:
    """What the load generator measured over one run."""

    num_requests: int
    num_failed: int
    duration_s: float
    num_output_tokens: int
    num_prompt_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft: LatencySummary
    itl: LatencySummary
    latency: LatencySummary
    tpot: LatencySummary
    itl_by_kind: dict[str, LatencySummary] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def client_metrics(records: Sequence[RequestRecord], duration_s: float | None = None) -> ClientMetrics:
    """Throughput and latency of `records`; the duration is first send to last completion
    unless given."""
    ok = [r for r in records if r.ok]
    if duration_s is None:
        ends = [r.done_s for r in ok]
        duration_s = (max(ends) - min(r.sent_s for r in records)) if ends else 0.0
    tokens = sum(r.num_output_tokens for r in ok)
    kinds = sorted({r.kind for r in ok})
    return ClientMetrics(
        num_requests=len(ok),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        num_output_tokens=tokens,
        num_prompt_tokens=sum(r.num_prompt_tokens for r in ok),
        requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        output_tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        ttft=LatencySummary.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=LatencySummary.of([x for r in ok for x in r.itls_s]),
        latency=LatencySummary.of([r.latency_s for r in ok]),
        tpot=LatencySummary.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl_by_kind={k: LatencySummary.of([x for r in ok if r.kind == k for x in r.itls_s]) for k in kinds}
        if len(kinds) > 1
        else {},
    )


# --- the services' side ----------------------------------------------------------------------


@dataclass(frozen=True)
class StageCounters:
    stage_index: int
    busy_ns: int
    idle_ns: int
    num_micro_batches: int = 0
    peak_in_flight: int = 0
    address: str = ""


@dataclass(frozen=True)
class ServiceSnapshot:
    """Counters of the scheduler, its stages and the KV service at one moment.

    `config` echoes what the scheduler runs with (async_scheduling, pipeline_parallel_size,
    enable_chunked_prefill, enable_prefix_caching, max_num_batched_tokens, ...) and what the
    KV service says of its prefix cache (`kv_enable_prefix_caching`), so a comparison can show
    that its arms really differ.
    """

    t_ns: int
    config: dict
    stages: tuple[StageCounters, ...]
    num_preemptions: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_micro_batches: int = 0
    num_finished_requests: int = 0
    kv_num_prefix_query_tokens: int = 0
    kv_num_prefix_hit_tokens: int = 0
    kv_internal_fragmentation: float = 0.0
    kv_external_fragmentation: float = 0.0
    kv_num_used_blocks: int = 0
    kv_num_total_blocks: int = 0
    kv_num_peak_used_blocks: int = 0
    transport: str = "grpc"


@dataclass(frozen=True)
class StageWindow:
    stage_index: int
    busy_fraction: float
    bubble_fraction: float
    num_micro_batches: int
    peak_in_flight: int


@dataclass(frozen=True)
class ServiceMetrics:
    """What the services did between two snapshots (`window` for stage times, `run` for counts).

    `bubble_fraction` of a stage is the share of the window it sat idle while the load
    generator had requests outstanding: the windows end when the last request is sent, so
    work was queued throughout and every idle moment is pipeline bubble (or scheduling and
    transport overhead the stage waited on).
    """

    stages: tuple[StageWindow, ...]
    num_preemptions: int
    num_generated_tokens: int
    num_prompt_tokens: int
    num_micro_batches: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    kv_internal_fragmentation: float
    kv_external_fragmentation: float
    kv_peak_used_blocks: int
    kv_total_blocks: int
    config: dict

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def tokens_per_micro_batch(self) -> float:
        """Tokens computed (prompt, recomputation and generated) per micro-batch dispatched."""
        n = self.num_micro_batches
        return (self.num_prompt_tokens + self.num_generated_tokens) / n if n else 0.0

    @property
    def mean_busy_fraction(self) -> float:
        return sum(s.busy_fraction for s in self.stages) / len(self.stages) if self.stages else 0.0

    @property
    def mean_bubble_fraction(self) -> float:
        return sum(s.bubble_fraction for s in self.stages) / len(self.stages) if self.stages else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["prefix_hit_rate"] = self.prefix_hit_rate
        out["mean_busy_fraction"] = self.mean_busy_fraction
        out["mean_bubble_fraction"] = self.mean_bubble_fraction
        out["tokens_per_micro_batch"] = self.tokens_per_micro_batch
        return out


def service_metrics(start: ServiceSnapshot, loaded: ServiceSnapshot, end: ServiceSnapshot) -> ServiceMetrics:
    """Stage busy and bubble over start..loaded (work queued throughout), counts over
    start..end, fragmentation as it stood at `loaded` (under load)."""
    window_ns = max(1, loaded.t_ns - start.t_ns)
    before = {s.stage_index: s for s in start.stages}
    stages = []
    for s in loaded.stages:
        b = before.get(s.stage_index)
        busy = s.busy_ns - (b.busy_ns if b else 0)
        idle = s.idle_ns - (b.idle_ns if b else 0)
        if idle <= 0 and busy <= window_ns:
            # the stage does not count idle time (the in-process engine): idle is the rest
            idle = window_ns - busy
        total = busy + idle
        busy_fraction = busy / total if total > 0 else 0.0
        stages.append(
            StageWindow(
                s.stage_index,
                busy_fraction,
                1.0 - busy_fraction if total > 0 else 0.0,
                s.num_micro_batches - (b.num_micro_batches if b else 0),
                s.peak_in_flight,
            )
        )
    return ServiceMetrics(
        stages=tuple(stages),
        num_preemptions=end.num_preemptions - start.num_preemptions,
        num_generated_tokens=end.num_generated_tokens - start.num_generated_tokens,
        num_prompt_tokens=end.num_prompt_tokens - start.num_prompt_tokens,
        num_micro_batches=end.num_micro_batches - start.num_micro_batches,
        prefix_query_tokens=end.kv_num_prefix_query_tokens - start.kv_num_prefix_query_tokens,
        prefix_hit_tokens=end.kv_num_prefix_hit_tokens - start.kv_num_prefix_hit_tokens,
        kv_internal_fragmentation=loaded.kv_internal_fragmentation,
        kv_external_fragmentation=loaded.kv_external_fragmentation,
        kv_peak_used_blocks=end.kv_num_peak_used_blocks,
        kv_total_blocks=end.kv_num_total_blocks,
        config=dict(end.config),
    )


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def quantiles_ms(seconds: Sequence[float], num: int = 101) -> list[float]:
    """`num` evenly spaced percentiles (0 .. 100) of `seconds`, in ms: a distribution small
    enough to keep in the results and draw as a CDF."""
    if not seconds or num < 2:
        return []
    ms = sorted(s * 1000 for s in seconds)
    return [round(percentile(ms, 100 * i / (num - 1)), 3) for i in range(num)]


def total_tokens(records: Iterable[RequestRecord]) -> int:
    return sum(r.num_output_tokens for r in records if r.ok)
