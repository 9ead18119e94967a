"""One party's ends of its rings, by logical name, kept current across ring swaps.

Used the same way by an actor in its child process and by the root process (the gateway writes
requests and reads outputs through the root's ends). When a peer restarts, the supervisor hands
out fresh segments; `swap` replaces the ends in place, so code that looks them up by name (or
reads through `mailbox`) carries on with the new ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.messages.control import InboundRing
from engine.runtime.mailbox import Mailbox
from engine.runtime.ring import RingClosed, RingReader, RingSpec, RingWriter


class RingEnds:
    def __init__(
        self,
        inbound: Mapping[str, InboundRing] | None = None,
        outbound: Mapping[str, RingSpec] | None = None,
    ) -> None:
        self._readers = {
            name: RingReader(ring.spec, ring.reader) for name, ring in (inbound or {}).items()
        }
        self._writers = {name: RingWriter(spec) for name, spec in (outbound or {}).items()}
        self.mailbox = Mailbox(self._readers)  # every inbound ring, awaited together
        # Traffic written so far, by logical ring name (across swaps): what /metrics shows.
        self.frames_sent: dict[str, int] = {}
        self.bytes_sent: dict[str, int] = {}

    @property
    def inbound_names(self) -> list[str]:
        return list(self._readers)

    @property
    def outbound_names(self) -> list[str]:
        return list(self._writers)

    def writer(self, ring: str) -> RingWriter:
        """The current writer of `ring` (a new object after a swap: look it up, don't keep it)."""
        try:
            return self._writers[ring]
        except KeyError:
            known = self.outbound_names
            raise KeyError(f"no outbound ring {ring!r}; outbound rings: {known}") from None

    def reader(self, ring: str) -> RingReader:
        """The current reader of `ring`; most code reads through `mailbox` instead."""
        try:
            return self._readers[ring]
        except KeyError:
            known = self.inbound_names
            raise KeyError(f"no inbound ring {ring!r}; inbound rings: {known}") from None

    async def recv(self) -> list[tuple[str, list[bytes]]]:
        """What arrived on any inbound ring (the mailbox's receipt)."""
        return await self.mailbox.recv()

    async def send_many(self, ring: str, frames: Sequence[bytes]) -> bool:
        """Write `frames` to `ring`, waiting for space (backpressure, never loss).

        Returns False when the ring was swapped while waiting: the frames were meant for a
        reader that has since been restarted, and what it had not read is stale anyway.
        """
        writer = self.writer(ring)
        try:
            await writer.send_many(frames)
        except RingClosed:
            if self._writers.get(ring) is writer:
                raise
            return False  # swapped (or all ends closed) while waiting for space
        self.frames_sent[ring] = self.frames_sent.get(ring, 0) + len(frames)
        self.bytes_sent[ring] = self.bytes_sent.get(ring, 0) + sum(map(len, frames))
        return True

    def fill(self) -> dict[str, float]:
        """How full each outbound ring is right now, by logical name (a ring being swapped or
        closed is left out)."""
        fills = {}
        for name, writer in list(self._writers.items()):
            try:
                fills[name] = writer.fill()
            except (ValueError, TypeError, IndexError):  # its memory was released meanwhile
                continue
        return fills

    def swap(self, inbound: Mapping[str, InboundRing], outbound: Mapping[str, RingSpec]) -> None:
        """Replace the named ends by ends of fresh segments and close the old ones.

        A send waiting for space on an old writer is woken and returns False.
        """
        for name, ring in inbound.items():
            self.reader(name)  # a clear KeyError for a ring this party does not read
            reader = RingReader(ring.spec, ring.reader)
            self._readers[name] = reader
            self.mailbox.replace(name, reader).close()
        for name, spec in outbound.items():
            old = self.writer(name)
            self._writers[name] = RingWriter(spec)
            old.close()

    def close(self) -> None:
        self.mailbox.close()
        writers = list(self._writers.values())
        self._writers.clear()
        self._readers.clear()
        for writer in writers:
            writer.close()
