"""The replay schedule: original inter-arrival times divided by --speed, in arrival order,
limited, with the model overridden or filled in and streaming forced."""

from __future__ import annotations

import math

import pytest

from engine.trace.format import TraceEntry, TraceRecord, make_body
from engine.trace.schedule import build_schedule, is_deterministic

ARRIVALS = [1000.0, 1000.5, 1002.0, 1001.0]  # out of order on purpose


def entries(arrivals: list[float] = ARRIVALS) -> list[TraceEntry]:
    out = []
    for i, arrival in enumerate(arrivals):
        body = {"prompt": f"p{i}", "max_tokens": 4, "model": "recorded-model", "stream": False}
        record = TraceRecord(v=1, arrival=arrival, endpoint="completions", body=make_body(body))
        out.append(TraceEntry(line=i + 1, record=record, body=body))
    return out


def test_send_times_keep_the_original_gaps_in_arrival_order() -> None:
    schedule = build_schedule(entries())
    assert [s.send_at for s in schedule] == [0.0, 0.5, 1.0, 2.0]
    assert [s.entry.line for s in schedule] == [1, 2, 4, 3]
    assert [s.position for s in schedule] == [0, 1, 2, 3]
    assert all(s.path == "/v1/completions" for s in schedule)


@pytest.mark.parametrize("speed", [0.5, 2.0, 10.0])
def test_speed_divides_every_gap(speed: float) -> None:
    normal = build_schedule(entries())
    scaled = build_schedule(entries(), speed=speed)
    for a, b in zip(normal, scaled, strict=True):
        assert b.send_at == pytest.approx(a.send_at / speed)


def test_infinite_speed_sends_everything_at_once() -> None:
    assert {s.send_at for s in build_schedule(entries(), speed=math.inf)} == {0.0}


@pytest.mark.parametrize("speed", [0.0, -1.0, math.nan])
def test_a_speed_that_is_not_positive_is_refused(speed: float) -> None:
    with pytest.raises(ValueError, match="speed must be a number > 0"):
        build_schedule(entries(), speed=speed)


def test_limit_keeps_the_first_arrivals() -> None:
    schedule = build_schedule(entries(), limit=2)
    assert [s.entry.line for s in schedule] == [1, 2]


def test_bodies_are_streamed_and_the_model_overridden() -> None:
    (first, *_) = build_schedule(entries(), model="other")
    assert first.body["model"] == "other" and first.body["stream"] is True
    assert first.body["stream_options"] == {"include_usage": True}
    assert first.entry.body["stream"] is False  # the recorded body is left as it was


def test_a_default_model_only_fills_in_missing_ones() -> None:
    given = entries()
    del given[0].body["model"]
    schedule = build_schedule(given, default_model="served")
    assert [s.body["model"] for s in schedule] == ["served"] + ["recorded-model"] * 3


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.0, "top_p": 0.5}, True),
        ({"temperature": 0.8, "seed": 3}, True),
        ({"temperature": 0.8}, False),
        ({}, False),  # OpenAI's default temperature is 1
    ],
)
def test_greedy_or_seeded_requests_are_deterministic(
    body: dict[str, object], expected: bool
) -> None:
    assert is_deterministic(body) is expected
