"""The gateway's Prometheus metrics, named after vLLM's API server's (`pagoda:` for `vllm:`).

They measure what a client sees: from the HTTP request's arrival to its text, so they
include queueing, tokenization and detokenization. The scheduler exports the same names for
its own view (tell them apart by the scrape job). One registry per app, no global state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]
        self.request_success = Counter(
            "pagoda:request_success", "Finished choices by finish reason.",
            labels + ["finished_reason"], registry=r)
        self.request_errors = Counter(
            "pagoda:request_errors", "Requests refused or failed, by HTTP status.",
            labels + ["status"], registry=r)
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=r)
        self.generation_tokens = Counter("pagoda:generation_tokens",
                                         "Tokens generated for finished requests.", labels, registry=r)
        self.request_prompt_tokens = Histogram(
            "pagoda:request_prompt_tokens", "Prompt tokens per request.", labels,
            buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "pagoda:request_generation_tokens", "Generated tokens per request.", labels,
            buckets=TOKEN_BUCKETS, registry=r)
        self.ttft = Histogram("pagoda:time_to_first_token_seconds",
                              "Request arrival to its first text.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagoda:inter_token_latency_seconds",
                             "Between consecutive output tokens of a choice.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagoda:e2e_request_latency_seconds", "Request arrival to its end.",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("pagoda:api_requests_in_flight",
                               "Generation requests the gateway is serving now.", labels, registry=r)

    def request(self) -> RequestTimer:
        return RequestTimer(self)

    def error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()


@dataclass
class RequestTimer:
    """The timings of one request (all its prompts and choices)."""

    metrics: GatewayMetrics
    start_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    last_token_s: dict[tuple[int, int], float] = field(default_factory=dict)

    def on_tokens(self, choice: tuple[int, int], num_tokens: int) -> None:
        if num_tokens <= 0:
            return
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

    def on_choice_finished(self, reason: str | None) -> None:
        m = self.metrics
        m.request_success.labels(m.model_name, reason or "unknown").inc()

    def on_finished(self, prompt_tokens: int, completion_tokens: int) -> None:
        m, name = self.metrics, self.metrics.model_name
        m.e2e.labels(name).observe(time.monotonic() - self.start_s)
        m.prompt_tokens.labels(name).inc(prompt_tokens)
        m.generation_tokens.labels(name).inc(completion_tokens)
        m.request_prompt_tokens.labels(name).observe(prompt_tokens)
        m.request_generation_tokens.labels(name).observe(completion_tokens)
