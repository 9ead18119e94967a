"""The P/D proxy's instances: which are up, how busy each is, and which one takes the next request.

Plain state without I/O (the proxy's app and its prober drive it), so the choice and the marking
are tested without servers. An instance goes down after `down_after` failures in a row (failed
probes of its /ready, and requests it left without a first byte) or at once when nothing listens
at its address; it is up again at the first probe that answers 200. A down instance is never
chosen, and what waits on it is told (`watch_down`) so that it can move elsewhere, unless it
still answers probes (a 503 while draining or restarting an actor): then it finishes them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Instance:
    url: str
    role: Role
    up: bool = True
    down_since: float | None = None  # wall clock (time.time()), for the 503 message
    last_error: str = ""
    outstanding: int = 0  # requests sent to it that have not finished yet
    failures: int = 0  # times it was marked down
    cuts: int = 0  # times what waited on it was told to move elsewhere (watch_down)
    strikes: int = 0  # failures in a row since its last good probe
    # Its last probe got an answer (a 503 while it drains or restarts an actor): alive, and the
    # choice of last resort when no instance of its role is up.
    answering: bool = True
    down_watchers: set[Callable[[], None]] = field(default_factory=set, repr=False)

    def describe(self) -> str:
        if self.up or self.down_since is None:
            return f"{self.url} up"
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.down_since))
        why = f": {self.last_error}" if self.last_error else ""
        return f"{self.url} down since {since}{why}"


class NoInstanceUp(Exception):
    """Every instance of `role` is down (or was already tried by this request)."""

    def __init__(self, role: Role, instances: list[Instance]) -> None:
        self.role = role
        named = "; ".join(i.describe() for i in instances)
        super().__init__(f"no {role.value} instance is up ({named})")


@dataclass
class InstancePool:
    """Instances of both roles in the order given on the command line."""

    instances: list[Instance]
    down_after: int = 3  # failures in a row that take an instance out of rotation
    _next: dict[Role, int] = field(default_factory=dict)  # round-robin cursor per role

    @classmethod
    def of(cls, prefill: Iterable[str], decode: Iterable[str], down_after: int = 3) -> InstancePool:
        prefills = [Instance(url, Role.PREFILL) for url in prefill]
        return cls(prefills + [Instance(url, Role.DECODE) for url in decode], down_after)

    def of_role(self, role: Role) -> list[Instance]:
        return [i for i in self.instances if i.role is role]

    def any_up(self, role: Role) -> bool:
        return any(i.up for i in self.of_role(role))

    def down(self) -> list[Instance]:
        return [i for i in self.instances if not i.up]

    def choose(self, role: Role, exclude: Iterable[Instance] = ()) -> Instance:
        """The live instance of `role` with the fewest outstanding requests; among equals, the
        first at or after the round-robin cursor, so equal instances take turns. With none up,
        one that still answers its probes. Raises NoInstanceUp when there is none (the
        excluded ones, already tried, do not count)."""
        members = self.of_role(role)
        skipped = {id(i) for i in exclude}
        live = [n for n, i in enumerate(members) if i.up and id(i) not in skipped]
        if not live:  # one restarting an actor queues the request and serves it once back
            live = [n for n, i in enumerate(members) if i.answering and id(i) not in skipped]
        if not live:
            raise NoInstanceUp(role, members)
        fewest = min(members[n].outstanding for n in live)
        cursor = self._next.get(role, 0)
        tied = [n for n in live if members[n].outstanding == fewest]
        chosen = min(tied, key=lambda n: (n - cursor) % len(members))
        self._next[role] = chosen + 1
        return members[chosen]

    def mark_down(
        self, instance: Instance, reason: str, now: float | None = None, *, cut_waiting: bool = True
    ) -> bool:
        """Mark `instance` down; True if it was up (its first failure since it came back).
        Whatever watches it (`watch_down`) is told, unless not `cut_waiting` (it is alive and
        finishes what it has; it only takes no new requests)."""
        instance.last_error = reason
        if cut_waiting:
            instance.answering = False  # not the choice of last resort either
        if not instance.up:
            return False
        instance.up = False
        instance.down_since = time.time() if now is None else now
        instance.failures += 1
        if cut_waiting:
            instance.cuts += 1
            for told in list(instance.down_watchers):
                told()
        return True

    def strike(
        self, instance: Instance, reason: str, now: float | None = None, *, cut_waiting: bool = True
    ) -> bool:
        """One failure that may be passing (a probe or a first byte that timed out): down at
        the `down_after`-th in a row. True if this one took it down."""
        instance.strikes += 1
        instance.last_error = reason
        if instance.strikes < self.down_after:
            return False
        return self.mark_down(instance, reason, now, cut_waiting=cut_waiting)

    def mark_up(self, instance: Instance) -> None:
        """A good probe: up (again), its strikes forgotten."""
        instance.up = True
        instance.answering = True
        instance.down_since = None
        instance.last_error = ""
        instance.strikes = 0

    @contextlib.contextmanager
    def watch_down(self, instance: Instance, told: Callable[[], None]) -> Iterator[None]:
        """`told()` is called if `instance` is marked down while inside (from the marking, so
        it must only schedule: e.g. expire a timeout)."""
        instance.down_watchers.add(told)
        try:
            yield
        finally:
            instance.down_watchers.discard(told)
