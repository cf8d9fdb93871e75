"""The comparisons: which two arms, which metric, and what is read back to trust the ratio.

Pure: works on `RunResult`s. Each comparison reports a ratio (these machines are noisy, so a
ratio of two arms run minutes apart on the same prompts is what can be trusted) and checks,
from what the services reported, that its feature really differed between the arms and that
both arms produced the number of output tokens the workload asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from bench.stats import ClientMetrics, ServiceMetrics, ratio


@dataclass
class RunResult:
    """One measured run of one arm."""

    model: str
    workload: str
    arm: str  # "pagoda", "sync", "pp2", "in-process", "transformers", "chunked-on", ...
    settings: str
    driver: str  # "http", "grpc", "in-process", "transformers"
    mode: str  # "closed", "open", "static-batch"
    num_requests: int
    expected_output_tokens: int
    client: ClientMetrics
    services: ServiceMetrics | None = None
    concurrency: int | None = None
    rate: float | None = None
    startup_s: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.model}/{self.workload}/{self.arm}"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["name"] = self.name
        out["client"] = self.client.to_dict()
        out["services"] = self.services.to_dict() if self.services else None
        return out


@dataclass(frozen=True)
class Check:
    what: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class ComparisonSpec:
    key: str
    title: str
    workload: str
    arm: str  # numerator
    baseline: str  # denominator
    metric: str  # a name in METRICS
    feature_checks: Callable[[RunResult, RunResult], list[Check]]
    note: str = ""


def _itl_p99_long(r: RunResult) -> float | None:
    s = r.client.itl_by_kind.get("long") or r.client.itl
    return s.p99_ms


METRICS: dict[str, tuple[str, Callable[[RunResult], float | None], bool]] = {
    # name: (label, getter, higher is better)
    "output_tokens_per_s": ("output tok/s", lambda r: r.client.output_tokens_per_s, True),
    "requests_per_s": ("req/s", lambda r: r.client.requests_per_s, True),
    "ttft_p50_ms": ("TTFT p50 ms", lambda r: r.client.ttft.p50_ms, False),
    "itl_p99_ms": ("ITL p99 ms", lambda r: r.client.itl.p99_ms, False),
    "itl_p99_long_ms": ("p99 ITL of long decodes, ms", _itl_p99_long, False),
}


def _config(r: RunResult, key: str):
    return r.services.config.get(key) if r.services else None


def _differs(what: str, key: str, want_a, want_b) -> Callable[[RunResult, RunResult], list[Check]]:
    def check(a: RunResult, b: RunResult) -> list[Check]:
        got_a, got_b = _config(a, key), _config(b, key)
        return [
            Check(
                what,
                got_a == want_a and got_b == want_b,
                f"{key}: {a.arm}={got_a}, {b.arm}={got_b} (read back from GetStats)",
            )
        ]

    return check


def _transformers(a: RunResult, b: RunResult) -> list[Check]:
    batches = b.extra.get("num_batches")
    return [
        Check(
            "baseline is static batching",
            b.driver == "transformers" and bool(batches),
            f"{b.arm}: {batches} padded generate() batch(es) of <= {b.concurrency}, "
            f"min_new_tokens = max_new_tokens; {a.arm}: continuous batching over {a.driver}",
        )
    ]


def _async(a: RunResult, b: RunResult) -> list[Check]:
    checks = _differs("async flag differs", "async_scheduling", True, False)(a, b)
    peak_a = max((s.peak_in_flight for s in a.services.stages), default=0) if a.services else 0
    peak_b = max((s.peak_in_flight for s in b.services.stages), default=0) if b.services else 0
    checks.append(
        Check(
            "micro-batches overlap only when async",
            peak_a >= 2 and peak_b <= 1,
            f"peak micro-batches in flight on a stage: {a.arm}={peak_a}, {b.arm}={peak_b}",
        )
    )
    return checks


def _pp(a: RunResult, b: RunResult) -> list[Check]:
    checks = _differs("stage count differs", "pipeline_parallel_size", 2, 1)(a, b)
    na, nb = _config(a, "num_stages"), _config(b, "num_stages")
    ta, tb = a.extra.get("threads_per_stage"), b.extra.get("threads_per_stage")
    checks.append(Check("stages reporting", na == 2 and nb == 1, f"stages in GetStats: {a.arm}={na}, {b.arm}={nb}"))
    checks.append(
        Check(
            "same total torch threads",
            ta is not None and tb is not None and ta * 2 == tb,
            f"{a.arm}: 2 stages x {ta} thread(s), {b.arm}: 1 stage x {tb} thread(s)",
        )
    )
    return checks


def _in_process(a: RunResult, b: RunResult) -> list[Check]:
    ka, kb = _config(a, "kv_address"), _config(b, "kv_address")
    return [
        Check(
            "transports differ",
            kb == "in-process" and ka not in (None, "in-process"),
            f"KV service at: {a.arm}={ka}, {b.arm}={kb}; {a.arm} driven over {a.driver}",
        )
    ]


def _chunked(a: RunResult, b: RunResult) -> list[Check]:
    checks = _differs("chunked-prefill flag differs", "enable_chunked_prefill", True, False)(a, b)
    ba, bb = _config(a, "max_num_batched_tokens"), _config(b, "max_num_batched_tokens")
    checks.append(
        Check(
            "token budgets as set",
            ba is not None and bb is not None and ba < bb,
            f"max_num_batched_tokens: {a.arm}={ba}, {b.arm}={bb} (off needs a budget >= "
            "the longest prompt; on lets it be small)",
        )
    )
    return checks


def _prefix(a: RunResult, b: RunResult) -> list[Check]:
    checks = _differs("prefix-caching flag differs (scheduler)", "enable_prefix_caching", True, False)(a, b)
    checks += _differs("prefix cache on/off (KV service)", "kv_enable_prefix_caching", True, False)(a, b)
    ha = a.services.prefix_hit_tokens if a.services else None
    hb = b.services.prefix_hit_tokens if b.services else None
    checks.append(
        Check("prefix hits only when on", bool(ha) and hb == 0, f"prefix-hit tokens: {a.arm}={ha}, {b.arm}={hb}")
    )
    return checks


COMPARISONS: dict[str, ComparisonSpec] = {
    "a": ComparisonSpec(
        "a",
        "Pagoda vs transformers static batching",
        "mixed",
        "pagoda",
        "transformers",
        "output_tokens_per_s",
        _transformers,
    ),
    "b": ComparisonSpec("b", "async vs sync scheduling", "mixed", "async", "pagoda", "output_tokens_per_s", _async),
    "c": ComparisonSpec("c", "PP=2 vs PP=1 (same total threads)", "mixed", "pp2", "pagoda", "output_tokens_per_s", _pp),
    "d": ComparisonSpec(
        "d",
        "full stack vs in-process engine",
        "mixed",
        "pagoda",
        "in-process",
        "output_tokens_per_s",
        _in_process,
        note="below 1: what the gRPC/HTTP boundaries cost",
    ),
    "e": ComparisonSpec(
        "e",
        "chunked prefill on vs off",
        "mixed",
        "chunked-on",
        "chunked-off",
        "itl_p99_long_ms",
        _chunked,
        note="below 1: chunking cut the decode stalls",
    ),
    "f": ComparisonSpec(
        "f", "prefix caching on vs off", "shared-prefix", "pagoda", "prefix-off", "output_tokens_per_s", _prefix
    ),
}
COMPARISON_KEYS = tuple(COMPARISONS)


def token_checks(r: RunResult) -> list[Check]:
    """The arm produced exactly what the workload asked for, as the client and the services saw it."""
    c = r.client
    checks = [
        Check(
            f"{r.arm}: every request succeeded",
            c.num_failed == 0 and c.num_requests == r.num_requests,
            f"{c.num_requests}/{r.num_requests} ok, {c.num_failed} failed",
        )
    ]
    checks.append(
        Check(
            f"{r.arm}: output tokens (client)",
            c.num_output_tokens == r.expected_output_tokens,
            f"{c.num_output_tokens} of {r.expected_output_tokens}",
        )
    )
    if r.services is not None:
        got = r.services.num_generated_tokens
        checks.append(
            Check(
                f"{r.arm}: output tokens (services)",
                got == r.expected_output_tokens,
                f"{got} of {r.expected_output_tokens} (scheduler's num_generated_tokens delta)",
            )
        )
    return checks


@dataclass
class ComparisonResult:
    key: str
    title: str
    model: str
    workload: str
    arm: str
    baseline: str
    metric: str
    value_arm: float | None
    value_baseline: float | None
    ratio: float | None
    higher_is_better: bool
    throughput_ratio: float | None
    ttft_p50_ratio: float | None
    itl_p99_ratio: float | None
    checks: list[Check]
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def compare(spec: ComparisonSpec, a: RunResult, b: RunResult) -> ComparisonResult:
    """`spec`'s ratio of `a` (its arm) over `b` (its baseline), with every check."""
    _, get, higher = METRICS[spec.metric]
    va, vb = get(a), get(b)
    checks = spec.feature_checks(a, b) + token_checks(a) + token_checks(b)
    checks.append(
        Check(
            "same work in both arms",
            a.expected_output_tokens == b.expected_output_tokens and a.num_requests == b.num_requests,
            f"{a.num_requests} requests / {a.expected_output_tokens} output tokens each",
        )
    )
    return ComparisonResult(
        key=spec.key,
        title=spec.title,
        model=a.model,
        workload=spec.workload,
        arm=a.arm,
        baseline=b.arm,
        metric=spec.metric,
        value_arm=va,
        value_baseline=vb,
        ratio=ratio(va, vb),
        higher_is_better=higher,
        throughput_ratio=ratio(a.client.output_tokens_per_s, b.client.output_tokens_per_s),
        ttft_p50_ratio=ratio(a.client.ttft.p50_ms, b.client.ttft.p50_ms),
        itl_p99_ratio=ratio(a.client.itl.p99_ms, b.client.itl.p99_ms),
        checks=checks,
        note=spec.note,
    )
