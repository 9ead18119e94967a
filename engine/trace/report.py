"""Figures of a replay next to those of the recording, the output comparison, and rendering.

Recorded figures come from the server side (its arrival to its token deliveries); replayed ones
from the client side, so a replay over a network adds the round trip to each. Imported traces
have no recorded figures: their column stays empty.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import msgspec

from engine.trace.client import ReplayResult
from engine.trace.format import TraceProblem, TraceRecord
from engine.trace.schedule import ScheduledRequest, is_deterministic

MAX_LISTED = 20  # failed requests and mismatches listed one by one; the rest are counted


class Latency(msgspec.Struct):
    """Seconds."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


class RunFigures(msgspec.Struct):
    requests: int
    ok: int
    failed: int
    duration_s: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft: Latency
    itl: Latency
    e2e: Latency


class FailedRequest(msgspec.Struct):
    line: int
    request_id: str | None
    error: str


class Mismatch(msgspec.Struct):
    line: int
    request_id: str | None
    choice: int
    what: str  # text | finish_reason | missing
    recorded: str
    replayed: str
    position: int | None = None  # first differing character of the text


class Comparison(msgspec.Struct):
    checked: int  # deterministic requests with a recorded success and a replayed success
    matched: int
    not_replayed: int  # deterministic, recorded, but the replay failed
    mismatches: list[Mismatch]
    # Why outputs may differ from the recording without a fault (None: they may not, as both
    # runs were --deterministic): then a mismatch is reported, not failed.
    may_differ: str | None = None


class ReplayReport(msgspec.Struct):
    trace: str
    url: str
    speed: float
    max_concurrency: int | None
    replay: RunFigures
    recorded: RunFigures | None
    failures: dict[str, int]  # reason → count
    failed_requests: list[FailedRequest]
    comparison: Comparison | None
    problems: list[str]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency(values: Sequence[float]) -> Latency:
    mean = sum(values) / len(values) if values else None
    return Latency(
        len(values), mean, percentile(values, 50), percentile(values, 90), percentile(values, 99)
    )


def recorded_itls(record: TraceRecord) -> list[float]:
    """Gaps between successive deliveries of each choice (tokens delivered together count once)."""
    gaps: list[float] = []
    for choice in record.choices:
        times = choice.token_times
        gaps.extend(b - a for a, b in itertools.pairwise(times) if b > a)
    return gaps


def replay_figures(results: Sequence[ReplayResult]) -> RunFigures:
    ok = [r for r in results if r.ok]
    duration = (
        max(r.finished_at for r in results) - min(r.sent_at for r in results) if results else 0.0
    )
    tokens = sum(r.completion_tokens for r in ok)
    return RunFigures(
        requests=len(results),
        ok=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        requests_per_s=len(ok) / duration if duration > 0 else 0.0,
        output_tokens=tokens,
        output_tokens_per_s=tokens / duration if duration > 0 else 0.0,
        ttft=latency([r.ttft for r in ok if r.ttft is not None]),
        itl=latency([gap for r in ok for gap in r.itls]),
        e2e=latency([r.e2e for r in ok]),
    )


def recorded_figures(records: Sequence[TraceRecord]) -> RunFigures | None:
    recorded = [r for r in records if r.recorded]
    if not recorded:
        return None
    ok = [r for r in recorded if r.outcome == "success"]
    start = min(r.arrival for r in recorded)
    end = max(r.arrival + (r.e2e or 0.0) for r in recorded)
    duration = end - start
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return RunFigures(
        requests=len(recorded),
        ok=len(ok),
        failed=len(recorded) - len(ok),
        duration_s=duration,
        requests_per_s=len(ok) / duration if duration > 0 else 0.0,
        output_tokens=tokens,
        output_tokens_per_s=tokens / duration if duration > 0 else 0.0,
        ttft=latency([r.ttft for r in ok if r.ttft is not None]),
        itl=latency([gap for r in ok for gap in recorded_itls(r)]),
        e2e=latency([r.e2e for r in ok if r.e2e is not None]),
    )


# Greedy and seeded outputs are reproducible only on batch-invariant kernels: elsewhere a
# request's rounding depends on the batch it shared and on whether its prompt's KV came from the
# prefix cache, and a near-tie between two tokens flips.
_WHY = (
    "a greedy or seeded output depends on the batch it shared and on whether its prompt came "
    "from the prefix cache; for an exact comparison, record and replay with servers started "
    "with --deterministic"
)


def compare_outputs(
    results: Sequence[ReplayResult], server_deterministic: bool | None = None
) -> Comparison:
    """Every deterministic request recorded as a success against what the replay returned;
    `server_deterministic`: whether the replaying server says it is (None: it does not say)."""
    checked = matched = not_replayed = 0
    mismatches: list[Mismatch] = []
    recorded_invariant = True
    for result in results:
        entry = result.request.entry
        record = entry.record
        if record.outcome != "success" or not is_deterministic(entry.body):
            continue
        recorded_invariant = recorded_invariant and record.deterministic
        if not result.ok:
            not_replayed += 1
            continue
        checked += 1
        found = _mismatches(entry.line, record, result)
        if found:
            mismatches.extend(found)
        else:
            matched += 1
    return Comparison(
        checked,
        matched,
        not_replayed,
        mismatches,
        _may_differ(recorded_invariant, server_deterministic),
    )


def _may_differ(recorded: bool, server: bool | None) -> str | None:
    if not recorded:
        return f"the recording was made without --deterministic: {_WHY}"
    if server is None:
        return f"this server does not say that it runs with --deterministic: {_WHY}"
    return None if server else f"this server runs without --deterministic: {_WHY}"


def _mismatches(line: int, record: TraceRecord, result: ReplayResult) -> list[Mismatch]:
    found = []
    rid = record.request_id
    for choice in record.choices:
        got = result.choices.get(choice.index)
        if got is None:
            found.append(Mismatch(line, rid, choice.index, "missing", _clip(choice.text), ""))
            continue
        if got.text != choice.text:
            at = next(
                (i for i, (a, b) in enumerate(zip(choice.text, got.text, strict=False)) if a != b),
                min(len(choice.text), len(got.text)),
            )
            found.append(
                Mismatch(
                    line,
                    rid,
                    choice.index,
                    "text",
                    _clip(choice.text[at:]),
                    _clip(got.text[at:]),
                    position=at,
                )
            )
        elif got.finish_reason != choice.finish_reason:
            found.append(
                Mismatch(
                    line,
                    rid,
                    choice.index,
                    "finish_reason",
                    str(choice.finish_reason),
                    str(got.finish_reason),
                )
            )
    return found


def build_report(
    *,
    trace: str,
    url: str,
    speed: float,
    max_concurrency: int | None,
    schedule: Sequence[ScheduledRequest],
    results: Sequence[ReplayResult],
    problems: Sequence[TraceProblem],
    compare: bool,
    server_deterministic: bool | None = None,
) -> ReplayReport:
    failed = [r for r in results if not r.ok]
    reasons = Counter(_reason(r) for r in failed)
    return ReplayReport(
        trace=trace,
        url=url,
        speed=speed,
        max_concurrency=max_concurrency,
        replay=replay_figures(results),
        recorded=recorded_figures([s.entry.record for s in schedule]),
        failures=dict(reasons.most_common()),
        failed_requests=[
            FailedRequest(r.request.entry.line, r.request.entry.record.request_id, r.error or "")
            for r in failed
        ],
        comparison=compare_outputs(results, server_deterministic) if compare else None,
        problems=[str(p) for p in problems],
    )


def _reason(result: ReplayResult) -> str:
    if result.status is not None and result.status != 200:
        return f"HTTP {result.status}"
    return (result.error or "unknown").split(":", 1)[0]


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
