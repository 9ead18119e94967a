"""When each request of a trace is sent, and with what body.

The schedule keeps the trace's inter-arrival times, divided by `speed` (2.0 = twice as fast,
`inf` = everything at once). Bodies are sent streamed, whatever the recording did, so the client
can time every token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.trace.format import ENDPOINT_PATHS, TraceEntry


@dataclass(frozen=True)
class ScheduledRequest:
    position: int  # in the schedule (arrival order)
    entry: TraceEntry
    send_at: float  # seconds after the replay starts
    path: str
    body: dict[str, Any]


def build_schedule(
    entries: list[TraceEntry],
    *,
    speed: float = 1.0,
    limit: int | None = None,
    model: str | None = None,
    default_model: str | None = None,
) -> list[ScheduledRequest]:
    """`model` replaces every body's model; `default_model` only fills in missing ones."""
    if not (speed > 0 and not math.isnan(speed)):
        raise ValueError(f"speed must be a number > 0 (inf = no waiting), got {speed}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    ordered = sorted(entries, key=lambda e: (e.record.arrival, e.line))
    if limit is not None:
        ordered = ordered[:limit]
    if not ordered:
        return []
    start = ordered[0].record.arrival
    return [
        ScheduledRequest(
            position=i,
            entry=entry,
            send_at=(entry.record.arrival - start) / speed,
            path=ENDPOINT_PATHS[entry.record.endpoint],
            body=replay_body(entry.body, model, default_model),
        )
        for i, entry in enumerate(ordered)
    ]


def replay_body(
    body: dict[str, Any], model: str | None, default_model: str | None = None
) -> dict[str, Any]:
    out = dict(body)
    if model is not None:
        out["model"] = model
    elif out.get("model") is None and default_model is not None:
        out["model"] = default_model
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    return out


def is_deterministic(body: dict[str, Any]) -> bool:
    """Greedy (temperature 0) or seeded requests give the same output on every run."""
    temperature = body.get("temperature")
    greedy = isinstance(temperature, int | float) and temperature == 0
    return greedy or body.get("seed") is not None
