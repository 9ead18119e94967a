"""A small OTLP/HTTP trace receiver for tests: a thread serving POST /v1/traces on 127.0.0.1,
decoding each ExportTraceServiceRequest (protobuf, with OpenTelemetry's own message classes)
into plain `ReceivedSpan`s a test can wait for."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

PATH = "/v1/traces"


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # hex, as in a traceparent header
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]  # (name, time, attributes)
    status_code: int
    status_message: str
    resource: dict[str, Any] = field(default_factory=dict)


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, which) if which else None


def _attributes(items: Any) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


def decode_spans(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        events=[
                            (e.name, e.time_unix_nano, _attributes(e.attributes))
                            for e in span.events
                        ],
                        status_code=span.status.code,
                        status_message=span.status.message,
                        resource=resource,
                    )
                )
    return spans


class Receiver:
    def __init__(self, server: ThreadingHTTPServer) -> None:
        self._server = server
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        self._changed = threading.Condition()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{PATH}"

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self.spans.extend(spans)
            self.posts += 1
            self._changed.notify_all()

    def wait_for(
        self, predicate: Callable[[ReceivedSpan], bool], count: int = 1, timeout: float = 30.0
    ) -> list[ReceivedSpan]:
        """The first `count` spans received that satisfy `predicate`; fails after `timeout`."""
        with self._changed:
            matched = self._changed.wait_for(
                lambda: sum(map(predicate, self.spans)) >= count, timeout=timeout
            )
            found = [s for s in self.spans if predicate(s)]
        assert matched, f"{len(found)} of {count} spans within {timeout} s: {found}"
        return found[:count]


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver: Receiver | None = None

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != PATH or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_error(404 if self.path != PATH else 415)
                return
            assert receiver is not None
            receiver.add(decode_spans(body))
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the test's output is no place for an access log

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(server)
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
