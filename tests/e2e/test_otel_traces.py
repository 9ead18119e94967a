"""--otlp-traces-endpoint on a running server: the shared server sends its request spans to an
in-process OTLP/HTTP receiver (tests/e2e/conftest.py). A request that brings a W3C traceparent
gets a span in that trace, parented as sent, with vLLM's attribute names and values that agree
with the response; its child spans are the request's hops. A restart as a span event is
tests/unit/test_request_traces.py."""

from __future__ import annotations

import itertools
import secrets
from typing import Any

import pytest

from engine.telemetry import attributes as attr
from tests.e2e.harness import Server

SERVER_KIND = 2  # OTLP's SPAN_KIND_SERVER


@pytest.fixture
def receiver(otlp: Any) -> Any:
    if otlp is None:
        pytest.fail("the OpenTelemetry SDK is not installed (pip install -e '.[test]')")
    return otlp


def test_a_request_span_continues_the_traceparent_with_vllms_attributes(
    server: Server, receiver: Any
) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=1"}
    body = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    with server.http() as http:
        response = http.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    spans = receiver.wait_for(lambda s: s.trace_id == trace_id, count=5, timeout=30.0)
    [span] = [s for s in spans if s.name == "llm_request"]
    assert span.parent_span_id == parent_id and span.kind == SERVER_KIND
    a = span.attributes
    assert a[attr.REQUEST_ID] == response.headers["x-request-id"]
    assert a[attr.RESPONSE_MODEL] == server.model
    assert a[attr.USAGE_PROMPT_TOKENS] == usage["prompt_tokens"]
    assert a[attr.USAGE_COMPLETION_TOKENS] == usage["completion_tokens"] == 6
    assert (a[attr.REQUEST_MAX_TOKENS], a[attr.REQUEST_N], a[attr.REQUEST_TEMPERATURE]) == (6, 1, 0)
    assert a[attr.RESPONSE_FINISH_REASONS] == ["length"]
    ttft, e2e = a[attr.LATENCY_TIME_TO_FIRST_TOKEN], a[attr.LATENCY_E2E]
    assert 0 < ttft <= e2e
    assert a[attr.LATENCY_TIME_IN_QUEUE] >= 0
    assert 0 < a[attr.LATENCY_TIME_IN_MODEL_PREFILL] < ttft
    assert a[attr.LATENCY_TIME_IN_MODEL_DECODE] == pytest.approx(e2e - ttft)
    assert span.end_ns - span.start_ns == pytest.approx(e2e * 1e9, abs=1e6)
    assert a[attr.RESTARTS] == 0 and span.events == [] and span.status_code == 0
    # The hops, in order, inside the request's span
    children = sorted((s for s in spans if s is not span), key=lambda s: s.start_ns)
    hops = ["tokenizer", "scheduler.queue", "worker.prefill", "decode"]
    assert [s.name for s in children] == hops
    assert all(s.parent_span_id == span.span_id for s in children)
    assert span.start_ns == children[0].start_ns and children[-1].end_ns == span.end_ns
    assert all(a.end_ns == b.start_ns for a, b in itertools.pairwise(children))


def test_a_request_without_a_traceparent_starts_a_trace(server: Server, receiver: Any) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    [span] = receiver.wait_for(lambda s: s.attributes.get(attr.REQUEST_ID) == request_id)
    assert span.name == "llm_request" and span.parent_span_id == ""
    assert span.resource["service.name"] == "engine"
