"""How long one piece of an actor's work may run before it counts as hung: a deadline from the
work's own size and the rate measured on the actor's earlier work.

A model step's time grows with its tokens, from milliseconds for a decode step of the default
model to seconds for a prefill chunk of a 1-2B model, so no fixed timeout fits both: one long
enough for the chunk waits far too long on a hung decode step, one short enough kills the chunk.
The deadline is `margin` times what the work's size takes at the slowest rate of the last
`window` pieces, never less than `floor`. The margin is wide: on a shared machine the same step
can take several times as long from one minute to the next, and a step taken for a hang is
killed and then run again (a mistaken kill costs far more than a late one). Before any piece was
measured there is no deadline (0): the first steps warm caches up and have no rate to go by;
a hung process is still found by the other signs (engine/runtime/liveness.py).
"""

from __future__ import annotations

from collections import deque


class WorkRate:
    def __init__(self, floor: float = 30.0, margin: float = 8.0, window: int = 64) -> None:
        self.floor, self.margin = floor, margin
        self._seconds_per_unit: deque[float] = deque(maxlen=window)

    def observe(self, units: int, seconds: float) -> None:
        """A piece of `units` (tokens) took `seconds`."""
        if units > 0:
            self._seconds_per_unit.append(seconds / units)

    def deadline(self, units: int) -> float:
        """Seconds a piece of `units` may run before it counts as hung; 0: no deadline yet."""
        if not self._seconds_per_unit:
            return 0.0
        return max(self.floor, self.margin * max(units, 1) * max(self._seconds_per_unit))
