"""What the supervisor runs, as data: child specs, ring declarations, strategy and intensity.

As in Erlang/OTP, a supervisor is configured, not coded: each child has a spec (how to start it,
whether to restart it, how long it may take to stop), the supervisor has a restart strategy and a
restart intensity. Rings are declared the same way, by logical name, with the child (or the root)
that writes them and the ones that read them; the supervisor turns them into segments.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from engine.messages.rings import Ring
from engine.messages.roles import ROOT  # the root process's own party name in ring declarations

__all__ = ["ROOT", "ChildSpec", "RingDecl", "SegmentDecl", "SupervisorSpec", "declare_ring"]

# Names end up inside shared-memory segment names: keep them short and plain.
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_ENTRY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Restart(enum.StrEnum):
    PERMANENT = "permanent"  # always restarted
    TRANSIENT = "transient"  # restarted only after an abnormal exit (status != 0)
    TEMPORARY = "temporary"  # never restarted

    def wants_restart(self, exitcode: int) -> bool:
        if self is Restart.PERMANENT:
            return True
        return self is Restart.TRANSIENT and exitcode != 0


class Strategy(enum.StrEnum):
    """Which children restart when one fails. A group always restarts as one unit."""

    ONE_FOR_ONE = "one_for_one"  # the failed child's unit
    ONE_FOR_ALL = "one_for_all"  # every unit
    REST_FOR_ONE = "rest_for_one"  # the failed child's unit and every unit started after it


class ChildSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    entry: str  # "module:Class" of an Actor subclass, imported in the child
    # What the child is to the application (typically a StrEnum member); the supervisor only
    # reports it in ChildStatus, so that callers never guess a role from a class name.
    role: str = ""
    config: bytes = b""  # handed to the actor as is
    restart: Restart = Restart.PERMANENT
    # Children sharing a group start together (all spawned, then all awaited: ranks whose
    # collective needs every member to join) and restart together (one_for_all within the group).
    group: str = ""
    shutdown_timeout: float = 5.0  # Stop -> this long -> SIGTERM -> this long -> SIGKILL
    ready_timeout: float = 60.0  # spawn -> Ready
    heartbeat_interval: float = 0.5  # heartbeats come from a thread work cannot block
    heartbeat_timeout: float = 2.0  # no status frame for this long: hung, SIGKILLed
    # The event loop not turning for this long, outside work marked busy(): hung, SIGKILLed
    stall_timeout: float = 10.0
    stopped_timeout: float = 0.5  # stopped by a signal (SIGSTOP) this long: hung, SIGKILLed


def declare_ring(ring: Ring[Any], writer: str, readers: Sequence[str]) -> RingDecl:
    """The declaration of a catalogued ring (engine/messages/ring_catalogue.py) between these
    parties: its name and capacity come from the catalogue (a per-rank ring's: `ring.at(r)`)."""
    if ring.per_rank:
        raise ValueError(f"ring {ring!r} is one per rank: declare ring.at(rank)")
    return RingDecl(name=ring.name, writer=writer, readers=tuple(readers), capacity=ring.capacity)


class RingDecl(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    writer: str  # a child's name or ROOT
    readers: tuple[str, ...]  # one (SPSC) or more (broadcast; reader index = position here)
    capacity: int = 1 << 20  # bytes of frame data

    @property
    def parties(self) -> frozenset[str]:
        return frozenset((self.writer, *self.readers))


class SegmentDecl(msgspec.Struct, frozen=True, kw_only=True):
    """A shared-memory segment of the run that is not a ring (a worker's KV cache, which its
    kv_transfer actor reads and writes too): created zero-filled by the supervisor at start,
    owner-only, kept across restarts of its parties, unlinked at shutdown."""

    name: str
    size: int  # bytes
    parties: tuple[str, ...]  # the children that map it


class SupervisorSpec(msgspec.Struct, frozen=True, kw_only=True):
    children: tuple[ChildSpec, ...]  # start order; shutdown runs in reverse
    rings: tuple[RingDecl, ...] = ()
    segments: tuple[SegmentDecl, ...] = ()
    strategy: Strategy = Strategy.ONE_FOR_ONE
    max_restarts: int = 3  # intensity: more than this many restarts ...
    max_seconds: float = 5.0  # ... within this many seconds escalates to shutdown
    backoff_initial: float = 0.1  # delay before a child's 2nd restart in the window; doubles after
    backoff_max: float = 5.0
    log_level: str = "INFO"
    # Keep a started spare process per entry of the restartable children, which a restart hands
    # its child to (engine/runtime/spares.py): faster restarts for the spares' memory.
    spares: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first thing wrong, its value and the form expected."""
        names = [child.name for child in self.children]
        _require(bool(names), "children", names, "at least one ChildSpec")
        for child in self.children:
            _validate_child(child)
        _require(len(set(names)) == len(names), "child names", names, "unique names")
        _require(ROOT not in names, "child name", ROOT, f"any name but {ROOT!r} (the root's)")
        parties = {*names, ROOT}
        ring_names = [ring.name for ring in self.rings]
        _require(len(set(ring_names)) == len(ring_names), "ring names", ring_names, "unique")
        for ring in self.rings:
            _validate_ring(ring, parties)
        segment_names = [segment.name for segment in self.segments]
        _require(
            len(set(segment_names)) == len(segment_names), "segment names", segment_names, "unique"
        )
        for segment in self.segments:
            _validate_segment(segment, set(names))
        strategies = " | ".join(f"Strategy.{s.name}" for s in Strategy)
        _require(isinstance(self.strategy, Strategy), "strategy", self.strategy, strategies)
        _require(self.max_restarts >= 0, "max_restarts", self.max_restarts, "an integer >= 0")
        _positive("max_seconds", self.max_seconds)
        _positive("backoff_initial", self.backoff_initial)
        _require(
            self.backoff_max >= self.backoff_initial,
            "backoff_max",
            self.backoff_max,
            f">= backoff_initial ({self.backoff_initial})",
        )
        _require(self.log_level in LOG_LEVELS, "log_level", self.log_level, str(LOG_LEVELS))


def start_units(children: tuple[ChildSpec, ...]) -> list[list[str]]:
    """Children as units in start order: a group is one unit, placed at its first member."""
    units: list[list[str]] = []
    by_group: dict[str, list[str]] = {}
    for child in children:
        if not child.group:
            units.append([child.name])
        elif child.group in by_group:
            by_group[child.group].append(child.name)
        else:
            by_group[child.group] = [child.name]
            units.append(by_group[child.group])
    return units


def _validate_child(child: ChildSpec) -> None:
    what = f"child {child.name!r}"
    _require(bool(_NAME.fullmatch(child.name)), "child name", child.name, _NAME.pattern)
    restarts = " | ".join(f"Restart.{r.name}" for r in Restart)
    _require(isinstance(child.restart, Restart), f"{what} restart", child.restart, restarts)
    _require(bool(_ENTRY.fullmatch(child.entry)), f"{what} entry", child.entry, "'module:Class'")
    _require(
        not child.group or bool(_NAME.fullmatch(child.group)),
        f"{what} group",
        child.group,
        f"'' or {_NAME.pattern}",
    )
    timeouts = ("shutdown_timeout", "ready_timeout", "heartbeat_interval", "heartbeat_timeout")
    for field in (*timeouts, "stall_timeout", "stopped_timeout"):
        _positive(f"{what} {field}", getattr(child, field))
    _require(
        child.heartbeat_timeout > child.heartbeat_interval,
        f"{what} heartbeat_timeout",
        child.heartbeat_timeout,
        f"> heartbeat_interval ({child.heartbeat_interval})",
    )


def _validate_ring(ring: RingDecl, parties: set[str]) -> None:
    what = f"ring {ring.name!r}"
    known = f"a child name or {ROOT!r}"
    _require(bool(_NAME.fullmatch(ring.name)), "ring name", ring.name, _NAME.pattern)
    _require(ring.writer in parties, f"{what} writer", ring.writer, known)
    _require(bool(ring.readers), f"{what} readers", ring.readers, "at least one reader")
    for reader in ring.readers:
        _require(reader in parties, f"{what} reader", reader, known)
    _require(len(set(ring.readers)) == len(ring.readers), f"{what} readers", ring.readers, "unique")
    _require(ring.writer not in ring.readers, f"{what} readers", ring.readers, "not its writer")
    _require(ring.capacity > 0, f"{what} capacity", ring.capacity, "a positive byte count")


def _validate_segment(segment: SegmentDecl, children: set[str]) -> None:
    what = f"segment {segment.name!r}"
    _require(bool(_NAME.fullmatch(segment.name)), "segment name", segment.name, _NAME.pattern)
    _require(segment.size > 0, f"{what} size", segment.size, "a positive byte count")
    for party in segment.parties:
        _require(party in children, f"{what} party", party, "a child name")


def _positive(field: str, value: float) -> None:
    _require(math.isfinite(value) and value > 0, field, value, "a number > 0")


def _require(ok: bool, field: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{field} must be {expected}, got {value!r}")
