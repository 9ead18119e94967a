"""What names one ring: the plain data a process needs to open one of its ends (`RingSpec`),
and what a ring of the catalogue is (`Ring`: name, parties, the channel it carries, capacity).

A RingSpec travels in every `ChildBoot` and `SwapRings` (messages/control.py), so it lives with
the messages; the runtime (runtime/ring.py) opens rings from it. The frame-size
arithmetic is here too, so that a sender can check a frame against a ring it only knows by its
spec. The engine's rings themselves are declared once, in ring_catalogue.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Generic, TypeVar

import msgspec

from engine.messages.codec import Channel

T = TypeVar("T")

MIN_CAPACITY = 64
MAX_CAPACITY = 1 << 31
MAX_READERS = 64
MAX_NAME_CHARS = 200  # NAME_MAX is 255; doorbells add a suffix to the ring's name
RECORD_OVERHEAD = 8  # count + one length: what a one-frame record costs beyond its payload
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class RingSpec(msgspec.Struct, frozen=True):
    """Everything a process needs to open one end of a ring (plain data: crosses `spawn`)."""

    # shm segment name: the run prefix (the run's directory, then a part of its own), then the
    # ring's, e.g. "engine-4242-0123456789abcdef/a1b2c3d4-r.tokens.0"
    name: str
    capacity: int  # bytes of frame data
    readers: int = 1  # 1 = SPSC; N > 1 = broadcast (every reader sees every frame)
    doorbell_dir: str = ""  # owner-only directory of the doorbell FIFOs; "" = per-user default

    def __post_init__(self) -> None:
        validate_segment_name(self.name)
        if not MIN_CAPACITY <= self.capacity <= MAX_CAPACITY:
            raise ValueError(
                f"ring capacity must be {MIN_CAPACITY}..{MAX_CAPACITY} bytes, got {self.capacity!r}"
            )
        if not 1 <= self.readers <= MAX_READERS:
            raise ValueError(f"ring readers must be 1..{MAX_READERS}, got {self.readers!r}")
        if self.doorbell_dir and not os.path.isabs(self.doorbell_dir):
            raise ValueError(
                f"doorbell_dir must be an absolute path or '', got {self.doorbell_dir!r}"
            )

    @property
    def max_frame_bytes(self) -> int:
        return self.capacity - RECORD_OVERHEAD


def validate_name(name: str) -> None:
    if not (isinstance(name, str) and _NAME_RE.fullmatch(name) and len(name) <= MAX_NAME_CHARS):
        raise ValueError(
            f"ring name must be 1-{MAX_NAME_CHARS} characters of letters, digits, '.', '_' or "
            f"'-', starting with a letter or digit (e.g. 'engine-4242-a1b2-tok2sched'); "
            f"got {name!r}"
        )


def validate_segment_name(name: str) -> None:
    """A name, or a directory's name, '/' and a name: never more levels, never a path out."""
    parts = name.split("/")
    if len(parts) > 2 or len(name) > MAX_NAME_CHARS:
        raise ValueError(
            f"ring name must be a name or 'directory/name' (at most {MAX_NAME_CHARS} "
            f"characters), got {name!r}"
        )
    for part in parts:
        validate_name(part)


class Ring(Generic[T]):
    """One ring of the catalogue: its logical name, the party that writes it and those that read
    it (roles, engine/messages/roles.py), the channel of the messages it carries, and its
    capacity in bytes. A per-rank ring (one per worker rank: "kv-events0", "kv-events1", ...) is
    declared once as a family; `at(rank)` is the ring of one rank.

    Senders encode through it (`encode` takes only the ring's message type, so mypy catches a
    message sent to the wrong ring); receivers decode by it (`ring_catalogue.ring_of(name)`)."""

    def __init__(
        self,
        name: str,
        channel: Channel[T],
        writer: str,
        readers: tuple[str, ...],
        capacity: int,
        *,
        per_rank: bool = False,
        family: Ring[T] | None = None,
    ) -> None:
        validate_name(name)
        if not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
            raise ValueError(f"ring {name!r}: capacity {capacity} is out of range")
        self.name = name
        self.channel = channel
        self.writer = writer
        self.readers = readers
        self.capacity = capacity
        self.per_rank = per_rank
        self.family = family  # the per-rank family this ring is one rank of; None for the rest

    def __repr__(self) -> str:
        pattern = f"{self.name}<rank>" if self.per_rank else self.name
        return f"Ring({pattern!r}, {self.writer} -> {', '.join(self.readers)}, {self.channel.name})"

    @property
    def entry(self) -> Ring[T]:
        """The catalogue's entry: the family of a per-rank ring, else the ring itself."""
        return self.family or self

    @property
    def max_frame_bytes(self) -> int:
        return self.capacity - RECORD_OVERHEAD

    def at(self, rank: int) -> Ring[T]:
        """Rank `rank`'s ring of a per-rank family."""
        if not self.per_rank:
            raise ValueError(f"ring {self.name!r} is one ring, not one per rank")
        name = f"{self.name}{rank}"
        return Ring(name, self.channel, self.writer, self.readers, self.capacity, family=self)

    def names(self, name: str) -> bool:
        """Whether `name` is this ring's (one of its ranks' for a per-rank family)."""
        if self.per_rank:
            rank = name.removeprefix(self.name)
            return rank != name and rank.isdigit()
        return name == self.name

    def encode(self, message: T) -> bytes:
        return self.channel.encode(message)

    def decode(self, frame: bytes | memoryview) -> T:
        return self.channel.decode(frame)

    def decode_many(self, frames: Iterable[bytes | memoryview]) -> list[T]:
        """Decode a drained batch, skipping (logging and counting) malformed frames."""
        return self.channel.decode_many(frames)
