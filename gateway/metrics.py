"""The gateway's Prometheus metrics, named after vLLM's API server's (`pagoda:` for `vllm:`).

They measure what a client sees: from the HTTP request's arrival to its text, so they
include queueing, tokenization and detokenization. The gateway's `/metrics` is the one
scrape target a dashboard needs: it also carries the engine's figures (requests running
and waiting, KV usage, prefix-cache counters, preemptions), read from the scheduler's
`GetStats` at scrape time (`EngineView`). One registry per app, no global state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Per token (inter-token, per output token): up to 80 s, as vLLM's.
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# Time to first token: vLLM's buckets, up to 2,560 s (a long prompt on a CPU takes minutes).
TTFT_BUCKETS = (*LATENCY_BUCKETS, 160.0, 640.0, 2560.0)
# A whole request: up to 7,680 s, as vLLM's end-to-end latency reaches.
REQUEST_LATENCY_BUCKETS = (*TTFT_BUCKETS, 7680.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class GatewayMetrics:
    def __init__(self, model_name: str, lora_info: Callable[[], tuple[int, list[str]]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]
        self.request_success = Counter(
            "pagoda:request_success", "Finished choices by finish reason.", labels + ["finished_reason"], registry=r
        )
        self.request_errors = Counter(
            "pagoda:request_errors", "Requests refused or failed, by HTTP status.", labels + ["status"], registry=r
        )
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter(
            "pagoda:generation_tokens", "Tokens generated for finished requests.", labels, registry=r
        )
        self.request_prompt_tokens = Histogram(
            "pagoda:request_prompt_tokens", "Prompt tokens per request.", labels, buckets=TOKEN_BUCKETS, registry=r
        )
        self.request_generation_tokens = Histogram(
            "pagoda:request_generation_tokens",
            "Generated tokens per request.",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pagoda:time_to_first_token_seconds",
            "Request arrival to its first text.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagoda:inter_token_latency_seconds",
            "Between consecutive output tokens of a choice.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagoda:e2e_request_latency_seconds",
            "Request arrival to its end.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "pagoda:api_requests_in_flight", "Generation requests the gateway is serving now.", labels, registry=r
        )
        self.tpot = Histogram(
            "pagoda:time_per_output_token_seconds",
            "Per request: (end - first token) / (generated tokens - 1).",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine = EngineView(model_name, lora_info)
        r.register(self.engine)

    def request(self) -> RequestTimer:
        return RequestTimer(self)

    @contextlib.contextmanager
    def serving(self, num_choices: int = 0, num_prompt_tokens: int = 0) -> Iterator[RequestTimer]:
        """One generation request (REST or gRPC) of `num_choices` choices in all: counted in
        flight while it runs; its timer. A request its client abandons (the stream behind it
        closed or cancelled before its end) is counted all the same: its unfinished choices
        as finished_reason "abort", with the tokens generated so far."""
        in_flight = self.in_flight.labels(self.model_name)
        in_flight.inc()
        timer = self.request()
        try:
            yield timer
        except (GeneratorExit, asyncio.CancelledError):
            timer.on_abandoned(num_choices, num_prompt_tokens)
            raise
        finally:
            in_flight.dec()

    def error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()


@dataclass
class RequestTimer:
    """The timings of one request (all its prompts and choices)."""

    metrics: GatewayMetrics
    start_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    last_token_s: dict[tuple[int, int], float] = field(default_factory=dict)
    num_generated: int = 0  # tokens of every choice so far
    num_finished_choices: int = 0
    ended: bool = False  # on_finished was called: the request is counted

    def on_tokens(self, choice: tuple[int, int], num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self.num_generated += num_tokens
        m, now = self.metrics, time.monotonic()
        if self.first_token_s is None:
            self.first_token_s = now
            m.ttft.labels(m.model_name).observe(now - self.start_s)
        previous = self.last_token_s.get(choice)
        if previous is not None:
            per_token = (now - previous) / num_tokens
            for _ in range(num_tokens):
                m.itl.labels(m.model_name).observe(per_token)
        self.last_token_s[choice] = now

    def on_delta(self, choice: tuple[int, int], num_tokens: int, finish_reason: str | None) -> None:
        """One choice's delta (REST and gRPC alike): its tokens, and its end if it ended."""
        self.on_tokens(choice, num_tokens)
        if finish_reason is not None:
            self.on_choice_finished(finish_reason)

    def on_choice_finished(self, reason: str | None) -> None:
        m = self.metrics
        self.num_finished_choices += 1
        m.request_success.labels(m.model_name, reason or "unknown").inc()

    def on_abandoned(self, num_choices: int, prompt_tokens: int) -> None:
        """The client went away before the request's end (its scheduler calls are aborted):
        each of its `num_choices` choices not finished yet ends as "abort", and the request
        counts with the tokens generated until then."""
        if self.ended:
            return
        for _ in range(num_choices - self.num_finished_choices):
            self.on_choice_finished("abort")
        self.on_finished(prompt_tokens, self.num_generated)

    def on_finished(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.ended = True
        m, name = self.metrics, self.metrics.model_name
        now = time.monotonic()
        m.e2e.labels(name).observe(now - self.start_s)
        if self.first_token_s is not None and completion_tokens > 1:
            m.tpot.labels(name).observe((now - self.first_token_s) / (completion_tokens - 1))
        m.prompt_tokens.labels(name).inc(prompt_tokens)
        m.generation_tokens.labels(name).inc(completion_tokens)
        m.request_prompt_tokens.labels(name).observe(prompt_tokens)
        m.request_generation_tokens.labels(name).observe(completion_tokens)


class EngineView:
    """The scheduler's figures as of its last `GetStats` (refreshed by the `/metrics` handler
    before each scrape), under vLLM's metric names. Nothing is exported while the scheduler
    has not answered (a scrape then shows `pagoda:engine_up 0`)."""

    def __init__(self, model_name: str, lora_info: Callable[[], tuple[int, list[str]]] | None = None) -> None:
        self.model_name = model_name
        self.stats = None  # scheduler_pb2.GetStatsResponse
        self.lora_info = lora_info  # () -> (max adapters, loaded adapters); None without LoRA

    def collect(self):
        labels, value = ["model_name"], [self.model_name]
        up = GaugeMetricFamily("pagoda:engine_up", "1 when the scheduler answered this scrape.", labels=labels)
        up.add_metric(value, 0.0 if self.stats is None else 1.0)
        yield up
        s = self.stats
        if s is None:
            return

        def gauge(name: str, doc: str, v: float):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(value, v)
            return family

        def counter(name: str, doc: str, v: float):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(value, v)
            return family

        kv = s.kv_cache
        yield gauge("pagoda:num_requests_running", "Requests prefilling or decoding.", s.num_running)
        yield gauge("pagoda:num_requests_waiting", "Requests waiting (preempted ones included).", s.num_waiting)
        yield gauge("pagoda:num_requests_preempted", "Waiting requests that were preempted.", s.num_preempted)
        yield gauge(
            "pagoda:kv_cache_usage_perc",
            "Fraction of KV blocks in use (1 = full).",
            kv.num_used_blocks / kv.num_total_blocks if kv.num_total_blocks else 0.0,
        )
        yield gauge("pagoda:kv_cache_used_blocks", "KV blocks in use.", kv.num_used_blocks)
        yield gauge("pagoda:kv_cache_cached_blocks", "KV blocks holding a cached prefix.", kv.num_cached_blocks)
        yield counter(
            "pagoda:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.num_prefix_query_tokens
        )
        yield counter("pagoda:prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.num_prefix_hit_tokens)
        yield from self._kv_tier(kv, gauge, counter)
        yield from self._disaggregation(s.disaggregation, gauge, counter)
        yield counter("pagoda:num_preemptions", "Requests preempted by recompute.", s.num_preemptions)
        yield from self._speculation(s, labels, value)
        yield self._device_info(s)
        yield from self._endpoint_picker(s, gauge)

    def _kv_tier(self, kv, gauge, counter):
        """The KV tier below the pool (--kv-offload): blocks held per medium, and its traffic."""
        if not kv.tier_host_capacity_blocks:
            return
        yield gauge("pagoda:kv_tier_host_blocks", "Blocks in the KV tier's host memory.", kv.tier_host_blocks)
        yield gauge("pagoda:kv_tier_disk_blocks", "Blocks in the KV tier's disk files.", kv.tier_disk_blocks)
        yield counter("pagoda:kv_tier_hits", "Prompt tokens loaded from the KV tier.", kv.num_tier_hit_tokens)
        yield counter("pagoda:kv_tier_saves", "Blocks saved to the KV tier (evicted).", kv.num_tier_saves)
        yield counter("pagoda:kv_tier_loads", "Blocks loaded from the KV tier.", kv.num_tier_loads)

    def _disaggregation(self, d, gauge, counter):
        """P/D disaggregation (issue 39): prompts' KV held for decode replicas, and pulled."""
        if not (d.num_exports or d.num_import_requests):
            return
        yield gauge("pagoda:pd_exports_held", "Finished prompts whose KV a prefill replica holds.", d.num_held)
        yield counter("pagoda:pd_exports", "Prompts computed and held for a decode replica.", d.num_exports)
        yield counter(
            "pagoda:pd_import_requests", "Requests that came with a prefill replica's KV.", d.num_import_requests
        )
        yield counter("pagoda:pd_imports", "Requests whose prompt KV was pulled (not computed).", d.num_imported)
        yield counter("pagoda:pd_import_failures", "Pulls that failed: the prompt was computed.", d.num_import_failures)
        yield counter("pagoda:pd_imported_blocks", "KV blocks pulled from prefill replicas.", d.num_imported_blocks)
        yield counter("pagoda:pd_imported_bytes", "KV bytes pulled, every stage's part.", d.num_imported_bytes)
        yield counter("pagoda:pd_import_seconds", "Seconds requests waited on their pulls.", d.import_seconds)

    def _endpoint_picker(self, s, gauge):
        """The figures an endpoint picker scrapes (the Gateway API Inference Extension's model
        server protocol, docs/proposals/003), under the vLLM names it reads by default: queue,
        running requests, KV usage (a fraction), the KV layout, the adapters."""
        kv = s.kv_cache
        yield gauge("vllm:num_requests_waiting", "Requests waiting (for an endpoint picker).", s.num_waiting)
        yield gauge("vllm:num_requests_running", "Requests running (for an endpoint picker).", s.num_running)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV usage, 1 = full (for an endpoint picker).",
            kv.num_used_blocks / kv.num_total_blocks if kv.num_total_blocks else 0.0,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's layout (for an endpoint picker).",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        info.add_metric([self.model_name, str(kv.block_size), str(kv.num_total_blocks)], 1.0)
        yield info
        if self.lora_info is not None:
            max_loras, loaded = self.lora_info()
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Adapters held, as of the value's time (for an endpoint picker).",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            lora.add_metric([str(max_loras), ",".join(sorted(loaded)), ""], time.time())
            yield lora

    @staticmethod
    def _speculation(s, labels: list[str], value: list[str]):
        """Speculative decoding's counters under vLLM's names (verify steps, drafted and
        accepted tokens, accepted per draft position)."""
        for name, doc, v in (
            ("pagoda:spec_decode_num_drafts", "Verify steps of a sequence (speculative decoding).", s.num_spec_drafts),
            ("pagoda:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.num_spec_draft_tokens),
            (
                "pagoda:spec_decode_num_accepted_tokens",
                "Draft tokens the target model accepted.",
                s.num_spec_accepted_tokens,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(value, v)
            yield family
        family = CounterMetricFamily(
            "pagoda:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by position after the known tokens.",
            labels=[*labels, "position"],
        )
        for position, v in enumerate(s.num_spec_accepted_per_position):
            family.add_metric([*value, str(position)], v)
        yield family

    def _device_info(self, s) -> GaugeMetricFamily:
        """1 per stage, labelled with the device it runs on: "emulated:PROFILE" marks a stack
        whose compute is a modelled wait (worker_svc/execution/emulated.py), never a measurement."""
        family = GaugeMetricFamily(
            "pagoda:device_info",
            "The device each pipeline stage runs on (emulated:PROFILE: an emulated one).",
            labels=["model_name", "stage", "device"],
        )
        for stage in s.stages:
            family.add_metric([self.model_name, str(stage.stage_index), stage.load_info.device], 1.0)
        return family
