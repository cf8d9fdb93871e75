"""OpenTelemetry tracing shared by the services: off at no cost unless configured.

A request's trace runs gateway -> scheduler -> every stage. The context travels as a W3C
`traceparent`: in gRPC metadata and in `GenerateRequest.trace_context` for per-request calls,
and per sequence inside each micro-batch plan on the long-lived stage streams (stream
metadata is sent once per stream, so it cannot carry per-request context).

Configuration (environment, read once by each service's entry point):
- `OTEL_EXPORTER_OTLP_ENDPOINT` or `PAGODA_OTLP_ENDPOINT`: export spans over OTLP/gRPC.
- `PAGODA_SPANS_FILE`: append finished spans as JSON lines (for tests and debugging).
Neither set: no provider is installed and the API's no-op tracer costs next to nothing.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.settings import OTLP_ENDPOINT, SPANS_FILE, env_value

_PROPAGATOR = TraceContextTextMapPropagator()


class JsonLinesSpanExporter(SpanExporter):
    """Writes each finished span as one JSON line: name, ids, parent, service, times."""

    def __init__(self, path: str, service: str) -> None:
        self.path = path
        self.service = service
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "service": self.service,
                        "trace_id": f"{ctx.trace_id:032x}",
                        "span_id": f"{ctx.span_id:016x}",
                        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
                        "start_ns": span.start_time,
                        "end_ns": span.end_time,
                        "attributes": dict(span.attributes or {}),
                    }
                )
            )
        with self._lock, open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def setup_tracing(service: str, environ: dict[str, str] | None = None) -> TracerProvider | None:
    """Install a tracer provider for this process when tracing is configured; else None."""
    otel = (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") if environ is None else environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    endpoint = env_value(OTLP_ENDPOINT, environ) or otel
    spans_file = env_value(SPANS_FILE, environ)
    if not endpoint and not spans_file:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": f"pagoda-{service}"}))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    if spans_file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(spans_file, service)))
    trace.set_tracer_provider(provider)
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def enabled() -> bool:
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def traceparent_of(span: trace.Span) -> str:
    """The W3C traceparent naming `span` as the parent of what comes next ('' if not recording)."""
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_from(traceparent: str) -> otel_context.Context | None:
    """A parent context from a traceparent string; None when there is none."""
    if not traceparent:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})
