"""The trace format: records round-trip, malformed lines are reported with their numbers and
skipped, the rest is kept."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from engine.trace.format import (
    TRACE_VERSION,
    RecordedChoice,
    TraceRecord,
    encode_record,
    make_body,
    parse_lines,
    read_trace,
)


def a_record(**overrides: object) -> TraceRecord:
    fields: dict[str, object] = {
        "v": TRACE_VERSION,
        "arrival": 100.5,
        "endpoint": "completions",
        "body": make_body({"prompt": "hello", "max_tokens": 2, "temperature": 0}),
        "request_id": "cmpl-1",
        "outcome": "success",
        "status": 200,
        "ttft": 0.01,
        "e2e": 0.02,
        "choices": [
            RecordedChoice(
                index=0,
                text=" a b",
                finish_reason="length",
                token_ids=[7, 8],
                token_times=[0.01, 0.02],
            )
        ],
    }
    fields.update(overrides)
    return TraceRecord(**fields)  # type: ignore[arg-type]


def test_a_record_round_trips_through_one_line() -> None:
    line = encode_record(a_record())
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    trace = parse_lines([line])
    assert not trace.problems
    (entry,) = trace.entries
    assert entry.line == 1 and entry.record.v == TRACE_VERSION
    assert entry.body == {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    assert entry.record.choices[0].token_ids == [7, 8] and entry.record.recorded


def test_malformed_lines_are_reported_by_number_and_the_rest_is_kept(tmp_path: Path) -> None:
    good = encode_record(a_record())
    lines = [
        good,
        b"{not json\n",
        b'{"v": 1, "arrival": 1.0, "body": {"prompt": "x"}}\n',  # no endpoint
        b"\n",  # blank lines are allowed
        encode_record(a_record(v=99)),
        encode_record(a_record(body=msgspec.Raw(b"[1, 2]"))),
        b'{"v": 1, "arrival": "soon", "endpoint": "completions", "body": {}}\n',
        b'{"arrival": 1.0, "endpoint": "completions", "body": {}}\n',  # no version
        good,
    ]
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(lines))
    trace = read_trace(path)
    assert [e.line for e in trace.entries] == [1, 9]
    problems = {p.line: p.message for p in trace.problems}
    assert set(problems) == {2, 3, 5, 6, 7, 8}
    assert "not valid JSON" in problems[2]
    assert "missing required field `endpoint`" in problems[3]
    assert "version 99" in problems[5] and f"expected {TRACE_VERSION}" in problems[5]
    assert "'body' must be a JSON object" in problems[6]
    assert "$.arrival" in problems[7]
    assert "missing required field `v`" in problems[8]
    assert str(trace.problems[0]).startswith("line 2: ")


def test_imported_lines_need_no_outcome() -> None:
    line = b'{"v": 1, "arrival": 0.5, "endpoint": "chat_completions", "body": {"messages": []}}'
    (entry,) = parse_lines([line]).entries
    assert not entry.record.recorded and entry.record.choices == []
    assert entry.record.source == "recorded"  # the default, for lines that do not say


@pytest.mark.parametrize("endpoint", ["embeddings", ""])
def test_an_unknown_endpoint_is_a_problem(endpoint: str) -> None:
    line = f'{{"v": 1, "arrival": 0, "endpoint": "{endpoint}", "body": {{}}}}'.encode()
    (problem,) = parse_lines([line]).problems
    assert problem.line == 1 and "endpoint" in problem.message
