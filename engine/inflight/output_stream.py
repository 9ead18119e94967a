"""A request's outputs on their way from the gateway to its client: bounded, never lossy.

The gateway puts one output per step for each request; the client's reader takes them out. A
client that stops reading must not make the root's memory grow with every step, nor may any
output be dropped. So the stream holds at most `capacity` items; past that, a new output is
merged into the last one (text and tokens appended, per sample), which keeps the count bounded
while the reader still gets every token. How long the stream has been full is what tells a
stalled client from a slow one: the gateway aborts a request whose stream stays full, unread,
for longer than the stalled-stream timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from engine.request.outputs import EngineError, RequestOutput, merge_into

Item = RequestOutput | EngineError


class OutputStream:
    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError(f"an output stream's capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._clock = clock
        self._items: deque[Item] = deque()
        self._readable = asyncio.Event()
        self._full_since: float | None = None

    def put_nowait(self, item: Item) -> None:
        last = self._items[-1] if self._items else None
        full = len(self._items) >= self.capacity
        if full and isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            merge_into(last, item)  # `last` cannot be finished: nothing follows a final output
            return
        self._items.append(item)
        if len(self._items) >= self.capacity and self._full_since is None:
            self._full_since = self._clock()
        self._readable.set()

    def get_nowait(self) -> Item:
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        self._full_since = None  # the reader is reading
        if not self._items:
            self._readable.clear()
        return item

    async def get(self) -> Item:
        while not self._items:
            await self._readable.wait()
        return self.get_nowait()

    def empty(self) -> bool:
        return not self._items

    def __len__(self) -> int:
        return len(self._items)

    def stalled_for(self) -> float:
        """Seconds the stream has been full without its reader taking anything (0: not full)."""
        if self._full_since is None:
            return 0.0
        return self._clock() - self._full_since
