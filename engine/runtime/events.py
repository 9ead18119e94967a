"""What the supervisor tells code in the root process: events to subscribe to, and a status table.

The gateway subscribes because a restart on the request path means resubmitting every unfinished
request (engine/inflight/registry.py); the admin socket shows `ChildStatus` rows.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from engine.messages.admin import ActorRow, RingTraffic
from engine.runtime.process_cpu import cpu_seconds


class ChildReady(msgspec.Struct, frozen=True):
    name: str
    pid: int
    generation: int
    info: dict[str, Any]  # what the actor's on_start returned


class ChildDied(msgspec.Struct, frozen=True):
    """A child exited without being asked to (a crash, a kill, a missed heartbeat, or status 0)."""

    name: str
    pid: int
    exitcode: int  # negative: killed by that signal
    reason: str


class RingsSwapped(msgspec.Struct, frozen=True):
    """The root's own ends of `rings` were replaced because `peer` restarted."""

    peer: str
    rings: list[str]


class ChildRestarted(msgspec.Struct, frozen=True):
    """A new generation of the child is ready; what was in flight through the old one is gone."""

    name: str
    pid: int
    generation: int
    restarts: int
    reason: str


class Escalated(msgspec.Struct, frozen=True):
    """The supervisor gave up restarting and is shutting everything down."""

    reason: str


class ReplicaFailed(msgspec.Struct, frozen=True):
    """One of several replicas (identical supervisors run side by side) gave up and stopped;
    the others go on. Sent by the replica set, never by a single supervisor."""

    replica: int
    reason: str


SupervisorEvent = ChildReady | ChildDied | RingsSwapped | ChildRestarted | Escalated | ReplicaFailed


class ChildStatus(msgspec.Struct, frozen=True):
    name: str
    entry: str
    role: str  # the child's ChildSpec.role
    group: str
    pid: int | None
    state: str  # starting | running | restarting | stopping | stopped | exited
    generation: int
    restarts: int
    last_restart_reason: str
    decode_errors: int  # malformed frames the child dropped, as of its last heartbeat
    # Written by all its generations, by outbound ring, as of the last heartbeat
    frames_sent: dict[str, int] = msgspec.field(default_factory=dict)
    bytes_sent: dict[str, int] = msgspec.field(default_factory=dict)
    ring_fill: dict[str, float] = msgspec.field(default_factory=dict)  # current generation's
    recovery_seconds: float = 0.0  # death seen to next generation ready, over all restarts


def ring_traffic(rows: list[ChildStatus]) -> list[RingTraffic]:
    """What each child has written to each of its rings and how full each is (for /metrics and
    admin stats); a ring it has yet to finish a first send to is there with its fill."""
    return [
        RingTraffic(
            actor=row.name,
            ring=ring,
            frames=row.frames_sent.get(ring, 0),
            bytes=row.bytes_sent.get(ring, 0),
            fill=row.ring_fill.get(ring, 0.0),
        )
        for row in rows
        for ring in sorted(row.frames_sent.keys() | row.ring_fill.keys())
    ]


def actor_cpu(rows: list[ChildStatus]) -> dict[str, float]:
    """CPU seconds of each live child's current process, and of this (the root) process."""
    seconds = {"root": cpu_seconds(os.getpid()) or 0.0}
    for row in rows:
        used = cpu_seconds(row.pid) if row.pid else None
        if used is not None:
            seconds[row.name] = used
    return seconds


def actor_rows(rows: list[ChildStatus]) -> list[ActorRow]:
    """The admin `actors` listing's rows."""
    return [
        ActorRow(
            name=row.name,
            role=row.role,
            pid=row.pid,
            state=row.state,
            restarts=row.restarts,
            last_restart_reason=row.last_restart_reason,
            generation=row.generation,
        )
        for row in rows
    ]
