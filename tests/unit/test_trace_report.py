"""Replay reports: percentiles, recorded vs replayed figures, the output comparison and the two
renderings (text for people, JSON for machines)."""

from __future__ import annotations

import msgspec
import pytest

from engine.trace.client import ReplayedChoice, ReplayResult
from engine.trace.format import RecordedChoice, TraceEntry, TraceProblem, TraceRecord, make_body
from engine.trace.render import render_text
from engine.trace.report import (
    ReplayReport,
    build_report,
    percentile,
    recorded_itls,
)
from engine.trace.schedule import build_schedule


def test_percentiles_interpolate_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([], 50) is None


def test_recorded_itl_counts_tokens_delivered_together_once() -> None:
    choice = RecordedChoice(index=0, token_ids=[1, 2, 3, 4], token_times=[0.1, 0.3, 0.3, 0.6])
    record = TraceRecord(
        v=1, arrival=0, endpoint="completions", body=make_body({}), choices=[choice]
    )
    assert recorded_itls(record) == pytest.approx([0.2, 0.3])


def recorded(i: int, text: str, body: dict[str, object]) -> TraceEntry:
    record = TraceRecord(
        v=1,
        arrival=10.0 + i,
        endpoint="completions",
        body=make_body(body),
        request_id=f"r{i}",
        outcome="success",
        status=200,
        completion_tokens=2,
        ttft=0.1,
        e2e=0.5,
        choices=[
            RecordedChoice(
                index=0, text=text, finish_reason="length", token_ids=[1, 2], token_times=[0.1, 0.5]
            )
        ],
    )
    return TraceEntry(line=i + 1, record=record, body=body)


GREEDY = {"prompt": "x", "max_tokens": 2, "temperature": 0}
SAMPLED = {"prompt": "x", "max_tokens": 2, "temperature": 0.9}


def a_report() -> ReplayReport:
    entries = [
        recorded(0, "same", GREEDY),
        recorded(1, "recorded text", GREEDY),
        recorded(2, "random", SAMPLED),  # not deterministic: never compared
        recorded(3, "lost", GREEDY),
    ]
    schedule = build_schedule(entries)
    results = []
    for request, text in zip(schedule, ["same", "recorded TEXT", "other", None], strict=True):
        result = ReplayResult(request, sent_at=float(request.position), status=200)
        result.finished_at = result.sent_at + 0.4
        if text is None:
            result.status, result.error = 429, "HTTP 429: queue full"
        else:
            result.ttft, result.itls, result.completion_tokens = 0.2, [0.2], 2
            result.choices[0] = ReplayedChoice([text], "length")
        results.append(result)
    return build_report(
        trace="t.jsonl",
        url="http://x",
        speed=1.0,
        max_concurrency=None,
        schedule=schedule,
        results=results,
        problems=[TraceProblem(7, "not valid JSON")],
        compare=True,
    )


def test_counts_figures_and_mismatches() -> None:
    report = a_report()
    assert (report.replay.requests, report.replay.ok, report.replay.failed) == (4, 3, 1)
    assert report.failures == {"HTTP 429": 1}
    assert report.replay.output_tokens == 6 and report.replay.duration_s == pytest.approx(3.4)
    assert report.replay.ttft.p50 == pytest.approx(0.2)
    assert report.recorded is not None
    assert (report.recorded.ok, report.recorded.failed) == (4, 0)
    assert report.recorded.duration_s == pytest.approx(3.5)
    assert report.recorded.itl.p50 == pytest.approx(0.4)
    comparison = report.comparison
    assert comparison is not None
    assert (comparison.checked, comparison.matched, comparison.not_replayed) == (2, 1, 1)
    (mismatch,) = comparison.mismatches
    assert (mismatch.line, mismatch.request_id, mismatch.what) == (2, "r1", "text")
    assert mismatch.position == 9 and mismatch.recorded == "text" and mismatch.replayed == "TEXT"
    assert report.problems == ["line 7: not valid JSON"]


@pytest.mark.parametrize(
    ("recorded_deterministic", "server", "why"),
    [
        (True, True, None),
        (False, True, "the recording was made without --deterministic"),
        (True, False, "this server runs without --deterministic"),
        (True, None, "this server does not say that it runs with --deterministic"),
    ],
)
def test_a_comparison_is_exact_only_between_two_deterministic_runs(
    recorded_deterministic: bool, server: bool | None, why: str | None
) -> None:
    """Elsewhere a greedy output depends on its batch and on the prefix cache: the report says
    so beside the differences, and replay does not fail on them."""
    entry = recorded(0, "recorded text", GREEDY)
    entry.record.deterministic = recorded_deterministic
    (request,) = build_schedule([entry])
    result = ReplayResult(request, sent_at=0.0, status=200)
    result.finished_at, result.completion_tokens = 0.5, 2
    result.choices[0] = ReplayedChoice(["other text"], "length")
    report = build_report(
        trace="t.jsonl",
        url="http://x",
        speed=1.0,
        max_concurrency=None,
        schedule=[request],
        results=[result],
        problems=[],
        compare=True,
        server_deterministic=server,
    )
    assert report.comparison is not None and len(report.comparison.mismatches) == 1
    if why is None:
        assert report.comparison.may_differ is None
        assert "can differ" not in render_text(report)
    else:
        assert report.comparison.may_differ is not None
        assert report.comparison.may_differ.startswith(why)
        assert "record and replay with servers started with --deterministic" in render_text(report)


def test_text_and_json_renderings() -> None:
    report = a_report()
    text = render_text(report)
    assert "requests ok / failed" in text and "3 / 1" in text and "4 / 0" in text
    assert "2 deterministic requests checked, 1 match, 1 mismatched" in text
    assert "line 2 (r1) choice 0: text differs at character 9" in text
    assert "line 4 (r3): HTTP 429: queue full" in text
    assert "line 7: not valid JSON" in text
    decoded = msgspec.json.decode(msgspec.json.encode(report), type=ReplayReport)
    assert decoded == report


def test_an_imported_trace_has_no_recorded_column() -> None:
    body = {"prompt": [1, 2], "max_tokens": 1}
    entry = TraceEntry(
        1, TraceRecord(v=1, arrival=0, endpoint="completions", body=make_body(body)), body
    )
    (request,) = build_schedule([entry])
    result = ReplayResult(request, sent_at=0.0, finished_at=1.0, status=200)
    report = build_report(
        trace="t",
        url="u",
        speed=2.0,
        max_concurrency=4,
        schedule=[request],
        results=[result],
        problems=[],
        compare=True,
    )
    assert report.recorded is None
    assert report.comparison is not None and report.comparison.checked == 0
    assert "speed 2x, at most 4 in flight" in render_text(report)
