"""The OTLP/HTTP exporter of request spans. OpenTelemetry is imported here only, when an
endpoint is set: the engine runs without the SDK installed.

Spans go through the SDK's BatchSpanProcessor: `record` only builds the span and queues it; a
thread of the SDK's exports batches, so a slow or absent collector never holds up the root's
event loop (a full queue drops spans, as the SDK does). The provider flushes at exit. Building
and encoding spans is the SDK's Python, so the cost grows with spans per request; the SDK's
sampler (OTEL_TRACES_SAMPLER, e.g. parentbased_traceidratio) is how an operator bounds it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from engine.telemetry import attributes as attr
from engine.telemetry.spans import RequestSpan, request_span

if TYPE_CHECKING:
    from engine.inflight.records import RequestRecord

log = logging.getLogger("engine.telemetry")

OTLP_TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces


class TracingUnavailable(RuntimeError):
    """--otlp-traces-endpoint was given but cannot be used; the message is one line."""


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: `endpoint` as given, or with OTLP's traces path when it
    names only a collector (http://host:4318)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint must be an http:// or https:// URL (OTLP over HTTP), "
            f"got {endpoint!r}"
        )
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + OTLP_TRACES_PATH
    return endpoint


class RequestTracer:
    def __init__(self, endpoint: str, model_name: str, service_name: str = "engine") -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as e:
            raise TracingUnavailable(
                f"--otlp-traces-endpoint needs the OpenTelemetry SDK ({e.name} is missing): "
                "pip install 'engine[otel]'"
            ) from None
        self.url = traces_url(endpoint)
        self.model_name = model_name
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url)))
        self._tracer = self._provider.get_tracer("engine")

    def record(self, record: RequestRecord) -> None:
        """The ended request's span, queued for export. A failure here is logged, never raised:
        tracing must not fail a request or the gateway."""
        try:
            self._emit(request_span(record, self.model_name, time.monotonic()), record)
        except Exception:
            log.exception("could not trace request %s", record.request_id)

    def _emit(self, span: RequestSpan, record: RequestRecord) -> None:
        trace = self._trace
        to_ns = _wall_clock_ns()
        parent = self._propagator.extract(record.request.trace_headers or {})
        root = self._tracer.start_span(
            attr.REQUEST_SPAN,
            context=parent,
            kind=trace.SpanKind.SERVER,
            start_time=to_ns(span.start),
            attributes=span.attributes,
        )
        if not root.is_recording():  # sampled out (OTEL_TRACES_SAMPLER): nothing to add
            root.end(end_time=to_ns(span.end))
            return
        inside = trace.set_span_in_context(root)
        for name, start, end in span.phases:
            child = self._tracer.start_span(name, context=inside, start_time=to_ns(start))
            child.end(end_time=to_ns(end))
        for when, epoch in span.restarts:
            root.add_event(attr.RESTART_EVENT, {attr.EVENT_EPOCH: epoch}, timestamp=to_ns(when))
        if span.error is not None:
            root.set_status(trace.Status(trace.StatusCode.ERROR, span.error))
        root.end(end_time=to_ns(span.end))

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter's thread."""
        self._provider.shutdown()


def _wall_clock_ns() -> Callable[[float], int]:
    """Monotonic seconds (the gateway's clock) to the wall-clock nanoseconds spans carry."""
    offset = time.time_ns() - time.monotonic_ns()
    return lambda monotonic: int(monotonic * 1e9) + offset


def open_request_tracer(endpoint: str | None, model_name: str) -> RequestTracer | None:
    """The tracer for `--otlp-traces-endpoint`; None without one. TracingUnavailable when the
    SDK is missing or the URL is not one."""
    if not endpoint:
        return None
    tracer = RequestTracer(endpoint, model_name)
    log.info("tracing requests to %s (OTLP/HTTP)", tracer.url)
    return tracer


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace context headers of an incoming request (traceparent, tracestate), to be
    continued by its span; None when it brings none."""
    found = {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}
    return found or None
