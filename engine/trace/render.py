"""A replay report as text for people: the two runs side by side, then what went wrong."""

from __future__ import annotations

from engine.trace.report import MAX_LISTED, Latency, ReplayReport, RunFigures

_NONE = "—"
_SCALARS = (
    ("duration (s)", "duration_s", "{:.2f}"),
    ("throughput (req/s)", "requests_per_s", "{:.2f}"),
    ("output tokens", "output_tokens", "{}"),
    ("output (tok/s)", "output_tokens_per_s", "{:.1f}"),
)


def render_text(report: ReplayReport) -> str:
    replay, recorded = report.replay, report.recorded
    speed = "as fast as possible" if report.speed == float("inf") else f"speed {report.speed:g}x"
    concurrency = f", at most {report.max_concurrency} in flight" if report.max_concurrency else ""
    lines = [
        f"replay of {report.trace} against {report.url} ({speed}{concurrency})",
        "",
        f"{'':28}{'replay':>26}{'recorded':>26}",
        _row("requests ok / failed", f"{replay.ok} / {replay.failed}", _ok_failed(recorded)),
    ]
    for label, name, pattern in _SCALARS:
        lines.append(_row(label, _fmt(replay, name, pattern), _fmt(recorded, name, pattern)))
    lines.append(f"{'latency (ms) p50 / p90 / p99':28}")
    for name, label in (("ttft", "  TTFT"), ("itl", "  ITL"), ("e2e", "  end-to-end")):
        mine: Latency = getattr(replay, name)
        theirs: Latency | None = getattr(recorded, name) if recorded else None
        lines.append(_row(label, _percentiles(mine), _percentiles(theirs)))
    if report.failures:
        lines += ["", "failed requests by reason:"]
        lines += [f"  {count:6d}  {reason}" for reason, count in report.failures.items()]
        for failed in report.failed_requests[:MAX_LISTED]:
            lines.append(f"  line {failed.line} ({failed.request_id or 'no id'}): {failed.error}")
        _more(lines, len(report.failed_requests))
    if report.comparison is not None:
        c = report.comparison
        lines += [
            "",
            f"compare: {c.checked} deterministic requests checked, {c.matched} match, "
            f"{len(c.mismatches)} mismatched choice(s)"
            + (f", {c.not_replayed} not compared (replay failed)" if c.not_replayed else ""),
        ]
        for m in c.mismatches[:MAX_LISTED]:
            where = f" at character {m.position}" if m.position is not None else ""
            lines.append(
                f"  line {m.line} ({m.request_id or 'no id'}) choice {m.choice}: {m.what} differs"
                f"{where}: recorded {m.recorded!r}, replayed {m.replayed!r}"
            )
        _more(lines, len(c.mismatches))
        if c.may_differ is not None:
            lines.append(f"  outputs can differ from the recording here: {c.may_differ}")
    if report.problems:
        lines += ["", f"skipped {len(report.problems)} malformed line(s) of the trace:"]
        lines += [f"  {p}" for p in report.problems[:MAX_LISTED]]
        _more(lines, len(report.problems))
    return "\n".join(lines)


def _row(label: str, replay: str, recorded: str) -> str:
    return f"{label:28}{replay:>26}{recorded:>26}"


def _ok_failed(figures: RunFigures | None) -> str:
    return _NONE if figures is None else f"{figures.ok} / {figures.failed}"


def _fmt(figures: RunFigures | None, name: str, pattern: str) -> str:
    return _NONE if figures is None else pattern.format(getattr(figures, name))


def _percentiles(stats: Latency | None) -> str:
    if stats is None or stats.count == 0:
        return _NONE
    values = (stats.p50, stats.p90, stats.p99)
    return " / ".join(_NONE if v is None else f"{v * 1000:.1f}" for v in values)


def _more(lines: list[str], total: int) -> None:
    if total > MAX_LISTED:
        lines.append(f"  … and {total - MAX_LISTED} more (--json lists all)")
