"""deploy/: the Grafana dashboard and the Prometheus config of the compose stack. Every query
of the dashboard names only metrics the gateway's /metrics exports (its own and the engine's,
read from the scheduler), and Prometheus scrapes that one target."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from services.pb import common_pb2, scheduler_pb2

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def exported_sample_names() -> set[str]:
    """Every sample name the gateway's /metrics shows once traffic flowed and the scheduler
    answered (histograms as _bucket/_sum/_count, counters as _total)."""
    metrics = GatewayMetrics("m")
    stats = scheduler_pb2.GetStatsResponse(health=common_pb2.HEALTH_STATUS_SERVING, num_running=1)
    stats.kv_cache.num_total_blocks = 8
    metrics.engine.stats = stats
    metrics.in_flight.labels("m")  # (the gateway makes its child at start)
    timer = metrics.request()
    timer.on_tokens((0, 0), 1)
    timer.on_tokens((0, 0), 1)
    timer.on_choice_finished("stop")
    timer.on_finished(3, 2)
    metrics.error(400)
    text = generate_latest(metrics.registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_dashboard_query_names_an_exported_metric():
    dashboard = json.loads((DEPLOY / "grafana" / "pagoda-dashboard.json").read_text())
    exported = exported_sample_names()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(dashboard["panels"]) >= 10 and exprs
    used = {name for expr in exprs for name in re.findall(r"pagoda:[a-zA-Z0-9_:]+", expr)}
    assert used and not used - exported, sorted(used - exported)
    # what vLLM's dashboard shows first is there: latencies, throughput, queue, KV, prefix cache
    for name in (
        "pagoda:time_to_first_token_seconds_bucket",
        "pagoda:inter_token_latency_seconds_bucket",
        "pagoda:num_requests_running",
        "pagoda:num_requests_waiting",
        "pagoda:kv_cache_usage_perc",
        "pagoda:prefix_cache_hits_total",
        "pagoda:generation_tokens_total",
    ):
        assert name in used, name


def test_prometheus_scrapes_the_gateway():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["gateway:8000"]
    assert config["scrape_configs"][0]["metrics_path"] == "/metrics"
