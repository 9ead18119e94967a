"""How long one piece of an actor's work may run before it counts as hung: a deadline from the
work's own size and the rate measured on the actor's earlier work.

A model step's time grows with its tokens, from milliseconds for a decode step of the default
model to seconds for a prefill chunk of a 1-2B model, so no fixed timeout fits both: one long
enough for the chunk waits far too long on a hung decode step, one short enough kills the chunk.
The deadline is `margin` times what the work's size takes at the slowest rate of the last
`window` pieces (a pessimistic estimate: a mistaken kill costs a restart, a late one only time),
never less than `floor`; before any piece was measured, `initial` (the first steps warm caches up).
"""

from __future__ import annotations

from collections import deque


class WorkRate:
    def __init__(
        self, floor: float = 30.0, margin: float = 4.0, initial: float = 300.0, window: int = 64
    ) -> None:
        self.floor, self.margin, self.initial = floor, margin, initial
        self._seconds_per_unit: deque[float] = deque(maxlen=window)

    def observe(self, units: int, seconds: float) -> None:
        """A piece of `units` (tokens) took `seconds`."""
        if units > 0:
            self._seconds_per_unit.append(seconds / units)

    def deadline(self, units: int) -> float:
        """Seconds a piece of `units` may run before it counts as hung."""
        if not self._seconds_per_unit:
            return self.initial
        return max(self.floor, self.margin * max(units, 1) * max(self._seconds_per_unit))
