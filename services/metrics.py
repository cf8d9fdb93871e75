"""Serving a service's Prometheus metrics: a collector that reads the service's own stats
at scrape time (no background refresh, no global registry), on its own HTTP port.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# (name, help, kind, value) with kind "counter" or "gauge"; a fifth item, when there, holds
# labels of that sample's own beside the fixed ones (an info gauge: `pagoda:device_info
# {device="emulated:..."} 1`)
Sample = tuple[str, str, str, float] | tuple[str, str, str, float, dict[str, str]]


class StatsCollector(Collector):
    """Yields `pagoda:*` metrics from a function returning samples; labels are fixed."""

    def __init__(self, read: Callable[[], Iterable[Sample]], labels: dict[str, str]) -> None:
        self._read = read
        self._labels = labels

    def collect(self):
        names, values = list(self._labels), list(self._labels.values())
        try:
            samples = list(self._read())
        except Exception:  # a scrape must not take the service down
            log.exception("reading metrics failed")
            return
        for name, help_text, kind, value, *own in samples:
            extra = own[0] if own else {}
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, help_text, labels=names + list(extra)
            )
            family.add_metric(values + list(extra.values()), value)
            yield family


def serve_metrics(
    port: int, host: str, read: Callable[[], Iterable[Sample]], labels: dict[str, str]
) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(StatsCollector(read, labels))
    start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return registry
