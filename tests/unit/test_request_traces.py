"""Request spans (engine/telemetry/) from the gateway's records, exported over OTLP/HTTP to an
in-process receiver: a restart the request lived through is an event on its span, a failure
its status; a bad endpoint or a missing SDK is one clear line. The server's side (a traceparent
continued, the attributes of a served request) is tests/e2e/test_otel_traces.py."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from engine.inflight.registry import Gateway
from engine.messages.outputs import OutputBatch, SampleDeltaText
from engine.messages.params import SamplingParams
from engine.messages.requests import EngineRequest, PromptTokens
from engine.messages.scheduling import FirstScheduled
from engine.request.outputs import EngineError
from engine.telemetry import attributes as attr
from engine.telemetry.tracer import (
    RequestTracer,
    TracingUnavailable,
    open_request_tracer,
    traces_url,
)
from tests.otlp_receiver import otlp_receiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
REPO = Path(__file__).resolve().parents[2]


def _delta(epoch: int, tokens: list[int], finish: str | None = None, first=None):
    return SampleDeltaText("r", epoch, 0, tokens, "x", None, finish, first=first)


def test_a_restart_is_an_event_and_a_failure_the_status() -> None:
    with otlp_receiver() as receiver:
        tracer = RequestTracer(receiver.url, "tiny")
        gateway = Gateway()
        gateway.on_request_end = tracer.record
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        gateway.register(
            EngineRequest(
                params=SamplingParams(max_tokens=3),
                prompt="hi",
                request_id="r",
                trace_headers=headers,
            )
        )
        gateway.learn_prompt(PromptTokens("r", 0, [1, 2]))
        gateway.deliver(OutputBatch([], [_delta(0, [7], first=FirstScheduled(0, 0.01, 0.02))], []))
        gateway.resubmit_all()  # as after an actor's restart on the request path
        gateway.deliver(OutputBatch([], [_delta(1, [8, 9], "length")], []))
        gateway.register(EngineRequest(params=SamplingParams(), prompt="x", request_id="bad"))
        gateway.fail("bad", EngineError("the engine failed: test", 503))
        tracer.shutdown()  # exports what is queued
        [span] = receiver.wait_for(lambda s: s.attributes.get(attr.REQUEST_ID) == "r")
        [failed] = receiver.wait_for(lambda s: s.attributes.get(attr.REQUEST_ID) == "bad")
    assert (span.name, span.trace_id, span.parent_span_id) == ("llm_request", TRACE_ID, PARENT_ID)
    [(name, when, event)] = span.events
    assert name == "restart" and event == {"engine.epoch": 1}
    assert span.start_ns < when < span.end_ns
    assert span.attributes[attr.RESTARTS] == 1
    assert span.attributes[attr.USAGE_COMPLETION_TOKENS] == 3
    assert span.attributes[attr.RESPONSE_FINISH_REASONS] == ["length"]
    assert span.status_code == 0  # unset: it was served
    assert failed.status_code == 2 and failed.status_message == "the engine failed: test"
    assert failed.parent_span_id == "" and failed.trace_id != TRACE_ID  # a trace of its own


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://c.example/otlp/v1/traces", "https://c.example/otlp/v1/traces"),
    ],
)
def test_an_endpoint_naming_only_a_collector_gets_the_traces_path(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url


@pytest.mark.parametrize("endpoint", ["grpc://collector:4317", "collector:4318", "http://"])
def test_an_endpoint_that_is_not_an_http_url_is_refused(endpoint: str) -> None:
    with pytest.raises(TracingUnavailable, match="must be an http:// or https:// URL"):
        traces_url(endpoint)


def test_without_the_sdk_the_flag_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n.partition(".")[0] == "opentelemetry"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if the SDK were not installed
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    assert open_request_tracer(None, "m") is None  # no flag: the SDK is not looked for
    with pytest.raises(TracingUnavailable) as refused:
        open_request_tracer("http://127.0.0.1:4318", "m")
    assert str(refused.value) == (
        "--otlp-traces-endpoint needs the OpenTelemetry SDK (opentelemetry is missing): "
        "pip install 'engine[otel]'"
    )


def test_the_engine_imports_opentelemetry_only_inside_the_tracer() -> None:
    """So the engine imports and runs without the SDK: no module imports it at load time."""
    found = []
    for path in sorted((REPO / "engine").rglob("*.py")):
        text = path.read_text()
        if "opentelemetry" not in text:
            continue
        tree = ast.parse(text, str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(name.partition(".")[0] == "opentelemetry" for name in names):
                found.append((str(path.relative_to(REPO)), node.col_offset > 0))
    assert found and all(indented for _, indented in found), found
    assert {path for path, _ in found} == {"engine/telemetry/tracer.py"}
