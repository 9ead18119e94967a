"""`--plot OUT.png`: latency CDFs and request timelines of the replay beside the recording.

Top row: cumulative distributions of TTFT, ITL and end-to-end latency, one line per run.
Bottom row: one horizontal bar per request from its send (arrival) to its end, a dot at its
first token; replay on the left, recording on the right, on their own time axes (the replay's
is the recording's divided by --speed). Imported traces have no recording: their panel shows
the arrivals only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.trace.client import ReplayResult
from engine.trace.format import TraceRecord
from engine.trace.report import recorded_itls

REPLAY_COLOR = "tab:blue"
RECORDED_COLOR = "tab:orange"
FAILED_COLOR = "tab:red"


def plot_replay(
    results: Sequence[ReplayResult], out: str | Path, *, title: str = "", speed: float = 1.0
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    records = [r.request.entry.record for r in results]
    ok = [r for r in results if r.ok]
    recorded_ok = [r for r in records if r.outcome == "success"]
    fig = plt.figure(figsize=(15, 9), layout="constrained")
    grid = fig.add_gridspec(2, 6, height_ratios=[1, 1.3])
    cdf_axes = [fig.add_subplot(grid[0, 2 * i : 2 * i + 2]) for i in range(3)]
    series = (
        (
            "time to first token",
            [r.ttft for r in ok if r.ttft is not None],
            [r.ttft for r in recorded_ok if r.ttft is not None],
        ),
        (
            "inter-token latency",
            [g for r in ok for g in r.itls],
            [g for r in recorded_ok for g in recorded_itls(r)],
        ),
        (
            "end-to-end latency",
            [r.e2e for r in ok],
            [r.e2e for r in recorded_ok if r.e2e is not None],
        ),
    )
    for ax, (name, replayed, recorded) in zip(cdf_axes, series, strict=True):
        _cdf(ax, replayed, "replay", REPLAY_COLOR)
        _cdf(ax, recorded, "recording", RECORDED_COLOR)
        ax.set_title(f"{name} (CDF)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if replayed or recorded:
            ax.legend(loc="lower right")
    replay_ax = fig.add_subplot(grid[1, :3])
    recorded_ax = fig.add_subplot(grid[1, 3:], sharey=replay_ax)
    _replay_timeline(replay_ax, results, speed)
    _recorded_timeline(recorded_ax, records)
    fig.suptitle(title or "replay vs recording")
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _cdf(ax: Any, seconds: Sequence[float], label: str, color: str) -> None:
    if not seconds:
        return
    values = sorted(s * 1000.0 for s in seconds)
    fractions = [(i + 1) / len(values) for i in range(len(values))]
    ax.step(values, fractions, where="post", color=color, label=f"{label} (n={len(values)})")


def _bar_width(count: int) -> float:
    """Thick bars for a few requests, thin ones for thousands."""
    return max(0.8, min(6.0, 300.0 / max(1, count)))


def _integer_ticks(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _replay_timeline(ax: Any, results: Sequence[ReplayResult], speed: float) -> None:
    width = _bar_width(len(results))
    for r in results:
        y = r.request.position
        color = REPLAY_COLOR if r.ok else FAILED_COLOR
        ax.hlines(y, r.sent_at, r.finished_at, color=color, linewidth=width)
        if r.ttft is not None:
            ax.plot(r.sent_at + r.ttft, y, ".", color="black", markersize=3)
    speed_text = "no waiting" if speed == float("inf") else f"speed {speed:g}x"
    ax.set_title(f"replay timeline ({speed_text}; red = failed, dot = first token)")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("request (arrival order)")
    ax.grid(alpha=0.3)
    _integer_ticks(ax)


def _recorded_timeline(ax: Any, records: Sequence[TraceRecord]) -> None:
    if not records:
        return
    start = min(r.arrival for r in records)
    if not any(r.recorded for r in records):
        ax.plot([r.arrival - start for r in records], range(len(records)), "|", color="gray")
        ax.set_title("trace arrivals (imported trace: no recorded outcome)")
    else:
        width = _bar_width(len(records))
        for y, r in enumerate(records):
            begin = r.arrival - start
            color = RECORDED_COLOR if r.outcome == "success" else FAILED_COLOR
            ax.hlines(y, begin, begin + (r.e2e or 0.0), color=color, linewidth=width)
            if r.ttft is not None:
                ax.plot(begin + r.ttft, y, ".", color="black", markersize=3)
        ax.set_title("recorded timeline (red = not a success, dot = first token)")
    ax.set_xlabel("seconds since the first request")
    ax.grid(alpha=0.3)
