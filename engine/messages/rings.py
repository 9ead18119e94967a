"""What names one ring: the plain data a process needs to open one of its ends.

It travels in every `ChildBoot` and `SwapRings` (messages/control.py), so it lives with the
messages; the runtime (actors/runtime/ring.py) opens rings from it. The frame-size arithmetic
is here too, so that a sender can check a frame against a ring it only knows by its spec.
"""

from __future__ import annotations

import os
import re

import msgspec

MIN_CAPACITY = 64
MAX_CAPACITY = 1 << 31
MAX_READERS = 64
MAX_NAME_CHARS = 200  # NAME_MAX is 255; doorbells add a suffix to the ring's name
RECORD_OVERHEAD = 8  # count + one length: what a one-frame record costs beyond its payload
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class RingSpec(msgspec.Struct, frozen=True):
    """Everything a process needs to open one end of a ring (plain data: crosses `spawn`)."""

    name: str  # shm segment name; starts with the run prefix, e.g. "engine-4242-a1b2-tok2sched"
    capacity: int  # bytes of frame data
    readers: int = 1  # 1 = SPSC; N > 1 = broadcast (every reader sees every frame)
    doorbell_dir: str = ""  # owner-only directory of the doorbell FIFOs; "" = per-user default

    def __post_init__(self) -> None:
        validate_name(self.name)
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
