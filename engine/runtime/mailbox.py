"""An actor's inbound rings, awaited together on the event loop and drained fairly."""

from __future__ import annotations

from collections.abc import Mapping

from engine.runtime.doorbell import DEFAULT_MAX_SPIN_US, Waiter
from engine.runtime.ring import RingClosed, RingReader


class Mailbox:
    """An actor's inbound rings, awaited together on the event loop, drained fairly.

    `recv` drains every ring that has frames, so a busy ring cannot hold back a quiet one, and
    the order in which rings are visited rotates by one per call, so no ring is always last.
    The mailbox owns its readers: `close` closes them; `replace` and `remove` hand the old one
    back for the caller to close (safe even while a `recv` is parked on it).
    """

    def __init__(
        self,
        readers: Mapping[str, RingReader] | None = None,
        *,
        max_spin_us: float = DEFAULT_MAX_SPIN_US,
    ) -> None:
        self._readers: dict[str, RingReader] = {}
        self._waiter = Waiter(max_spin_us)
        self._rotation = 0
        self._closed = False
        for name, reader in (readers or {}).items():
            self.add(name, reader)

    @property
    def names(self) -> list[str]:
        return list(self._readers)

    def add(self, name: str, reader: RingReader) -> None:
        self._check_open()
        if name in self._readers:
            raise ValueError(f"mailbox already has a ring named {name!r}; use replace() to swap it")
        self._readers[name] = reader
        self._waiter.interrupt()  # a parked recv re-parks including the new ring

    def replace(self, name: str, reader: RingReader) -> RingReader:
        """Swap the ring read under `name` (after a peer restart); returns the old reader."""
        self._check_open()
        if name not in self._readers:
            raise KeyError(f"mailbox has no ring named {name!r}; rings: {self.names}")
        self._waiter.interrupt()  # before the caller closes the old reader a recv may park on
        old = self._readers[name]
        self._readers[name] = reader
        return old

    def remove(self, name: str) -> RingReader | None:
        self._waiter.interrupt()
        return self._readers.pop(name, None)

    def drain(self) -> list[tuple[str, list[bytes]]]:
        """(ring name, frames) for every ring with frames now, in rotating order; never waits."""
        self._check_open()
        names = list(self._readers)
        if not names:
            return []
        first = self._rotation % len(names)
        self._rotation = first + 1
        batch: list[tuple[str, list[bytes]]] = []
        for name in names[first:] + names[:first]:
            frames = self._readers[name].drain()
            if frames:
                batch.append((name, frames))
        return batch

    async def recv(self) -> list[tuple[str, list[bytes]]]:
        """Wait until any ring has frames; return (ring name, frames) for every ring with any."""
        while True:
            batch = self.drain()
            if batch:
                return batch
            await self._waiter.wait(list(self._readers.values()))

    def close(self) -> None:
        """Wake any waiting recv (it fails: the mailbox is closed) and close every reader."""
        if self._closed:
            return
        self._closed = True
        self._waiter.interrupt()
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RingClosed("mailbox is closed")

    def __len__(self) -> int:
        return len(self._readers)
