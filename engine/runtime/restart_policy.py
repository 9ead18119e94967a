"""Restart decisions: which children restart together, and whether restarting is still allowed.

Plain logic without processes or clocks of its own, so it is testable and reads like the OTP rules.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from engine.runtime.child_spec import Strategy


def restart_set(strategy: Strategy, units: list[list[str]], failed: str) -> list[str]:
    """The children to restart (in start order) after `failed` failed; its group comes along."""
    index = next(i for i, unit in enumerate(units) if failed in unit)
    if strategy is Strategy.ONE_FOR_ONE:
        chosen = units[index : index + 1]
    elif strategy is Strategy.ONE_FOR_ALL:
        chosen = units
    else:
        chosen = units[index:]
    return [name for unit in chosen for name in unit]


class RestartIntensity:
    """At most `max_restarts` restarts in any `max_seconds` window; within it, growing delays.

    The intensity counts every child's restarts together, as OTP's does. The backoff is each
    child's own: its first restart in a window happens at once (as in OTP), each further one of
    the same child waits twice as long as the one before, from `backoff_initial` up to
    `backoff_max`. So a child that fails on start-up does not spin the machine before the
    intensity check stops it, while children failing independently do not delay each other.
    """

    def __init__(
        self,
        max_restarts: int,
        max_seconds: float,
        backoff_initial: float,
        backoff_max: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_restarts = max_restarts
        self.max_seconds = max_seconds
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._clock = clock
        self._recent: deque[tuple[float, str]] = deque()  # (when, child) within the window

    def record(self, child: str) -> bool:
        """Count a restart of `child` now; False when it would exceed the intensity (time to
        escalate)."""
        now = self._clock()
        while self._recent and now - self._recent[0][0] > self.max_seconds:
            self._recent.popleft()
        self._recent.append((now, child))
        return len(self._recent) <= self.max_restarts

    def backoff(self, children: Iterable[str]) -> float:
        """Seconds to wait before restarting `children` (just recorded): the longest of theirs."""
        delays = [0.0]
        for child in children:
            earlier = sum(1 for _, name in self._recent if name == child) - 1
            if earlier > 0:
                delays.append(min(self.backoff_initial * 2.0 ** (earlier - 1), self.backoff_max))
        return max(delays)

    def describe(self) -> str:
        return (
            f"{len(self._recent)} restarts within {self.max_seconds:g} s "
            f"(at most {self.max_restarts} allowed)"
        )
