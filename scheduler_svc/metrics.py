"""Prometheus metrics of the scheduler, named after vLLM's (`pagoda:` for `vllm:`).

So that existing vLLM dashboards adapt by a rename. Counters and histograms are updated by
the engine's observer (`scheduler_svc.observer`) as requests flow; gauges (queue depth,
running, KV blocks) are read from the engine when scraped. One registry per engine, no
global state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Up to vLLM's largest: its TTFT buckets reach 2,560 s and its request latency 7,680 s (a
# long prompt on a CPU takes minutes; past the top bucket a latency is only "+Inf").
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
    160.0,
    640.0,
    2560.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class SchedulerMetrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name
        r = self.registry
        self.request_success = Counter(
            "pagoda:request_success", "Finished requests by finish reason.", labels + ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens received.", labels, registry=r)
        self.generation_tokens = Counter("pagoda:generation_tokens", "Tokens generated.", labels, registry=r)
        self.preemptions = Counter("pagoda:num_preemptions", "Requests preempted by recompute.", labels, registry=r)
        self.ttft = Histogram(
            "pagoda:time_to_first_token_seconds", "Arrival to first token.", labels, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pagoda:inter_token_latency_seconds",
            "Between consecutive output tokens.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagoda:e2e_request_latency_seconds", "Arrival to finish.", labels, buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "pagoda:request_queue_time_seconds",
            "Arrival to first scheduled.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "pagoda:micro_batch_num_tokens", "Tokens per micro-batch.", labels, buckets=TOKEN_BUCKETS, registry=r
        )
        self.running = Gauge("pagoda:num_requests_running", "Requests running.", labels, registry=r)
        self.waiting = Gauge(
            "pagoda:num_requests_waiting", "Requests waiting, by tenant.", labels + ["tenant"], registry=r
        )
        self.swapped = Gauge(
            "pagoda:num_requests_preempted", "Waiting requests that were preempted.", labels, registry=r
        )
        self.kv_used = Gauge("pagoda:kv_cache_used_blocks", "KV blocks in use.", labels, registry=r)
        self.kv_free = Gauge(
            "pagoda:kv_cache_free_blocks", "KV blocks free (cached ones included).", labels, registry=r
        )
        self.kv_cached = Gauge(
            "pagoda:kv_cache_cached_blocks", "KV blocks holding a cached prefix.", labels, registry=r
        )
        self.kv_usage = Gauge("pagoda:kv_cache_usage_perc", "Fraction of KV blocks in use.", labels, registry=r)
        # counters, as vLLM's: advanced as the KV service's answers come (on_prefix_lookups)
        self.prefix_queries = Counter(
            "pagoda:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r
        )
        self.prefix_hits = Counter(
            "pagoda:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r
        )
        self.prefix_hit_rate = Gauge(
            "pagoda:prefix_cache_hit_rate", "Prefix-cache hit rate in tokens.", labels, registry=r
        )
        self.stage_busy = Gauge(
            "pagoda:stage_busy_seconds", "Seconds each stage spent computing.", labels + ["stage"], registry=r
        )
        self.stage_idle = Gauge(
            "pagoda:stage_idle_seconds", "Seconds each stage waited.", labels + ["stage"], registry=r
        )

        # the per-token paths use their labelled children directly
        self._prompt_tokens = self.prompt_tokens.labels(model_name)
        self._generation_tokens = self.generation_tokens.labels(model_name)
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)

    # --- updated as requests flow -----------------------------------------------------------

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self._prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int) -> None:
        self._generation_tokens.inc(num_tokens)

    def on_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def on_scheduled(self, queue_seconds: float) -> None:
        self.queue_time.labels(self._model).observe(queue_seconds)

    def on_finished(self, reason: str, seconds: float) -> None:
        self.request_success.labels(self._model, reason).inc()
        self.e2e.labels(self._model).observe(seconds)

    def on_prefix_lookups(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries.labels(self._model).inc(num_query_tokens)
        self.prefix_hits.labels(self._model).inc(num_hit_tokens)

    def on_preempted(self, count: int = 1) -> None:
        self.preemptions.labels(self._model).inc(count)

    def on_micro_batch(self, num_tokens: int) -> None:
        self.batch_tokens.labels(self._model).observe(num_tokens)

    # --- refreshed before a scrape ----------------------------------------------------------

    def refresh(self, summary: dict, kv_stats=None, stage_stats: list[dict] | None = None) -> None:
        m = self._model
        self.running.labels(m).set(summary["num_running"])
        self.swapped.labels(m).set(summary["num_preempted"])
        tenants = summary["queue_by_tenant"]
        for tenant in set(tenants) | {""}:
            self.waiting.labels(m, tenant).set(tenants.get(tenant, 0))
        if kv_stats is not None:
            self.kv_used.labels(m).set(kv_stats.num_used_blocks)
            self.kv_free.labels(m).set(kv_stats.num_free_blocks + kv_stats.num_evictable_blocks)
            self.kv_cached.labels(m).set(kv_stats.num_cached_blocks)
            self.kv_usage.labels(m).set(kv_stats.num_used_blocks / max(1, kv_stats.num_blocks))
            self.prefix_hit_rate.labels(m).set(kv_stats.prefix_hit_rate)
        for st in stage_stats or []:
            stats = st.get("stats")
            if stats is not None:
                self.stage_busy.labels(m, str(st["stage_index"])).set(stats.busy_ns / 1e9)
                self.stage_idle.labels(m, str(st["stage_index"])).set(stats.idle_ns / 1e9)
            elif "busy_ns" in st:
                self.stage_busy.labels(m, str(st["stage_index"])).set(st["busy_ns"] / 1e9)
