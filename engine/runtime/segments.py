"""Shared-memory segments of a run that are not rings (`SegmentDecl`): a CPU worker's KV cache
(mapped by its kv_transfer actor too, under P/D) and the scheduler's prefix index.

They live like rings: named `<run prefix>s.<name>` in the run's directory (so a crashed run's are
swept at the next start), owner-only, checked when mapped, created by the supervisor before any
child starts and unlinked at its shutdown. Unlike a ring's, a segment is kept when a party
restarts, and what it holds with it: a restarted worker finds the KV its predecessor wrote
(engine/launch/lasting_kv.py). Pages are not populated up front: a large KV cache costs memory
only as blocks are used.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping, Sequence

from engine.runtime.child_spec import SegmentDecl
from engine.runtime.private_files import open_private
from engine.runtime.shm import create_segment, segment_path, unlink_segment


def create_segments(decls: Sequence[SegmentDecl], prefix: str) -> dict[str, str]:
    """Create every declared segment; logical name -> shared-memory name."""
    created: dict[str, str] = {}
    try:
        for decl in decls:
            name = f"{prefix}s.{decl.name}"
            create_segment(name, decl.size).close()
            created[decl.name] = name
    except BaseException:
        destroy_segments(created)
        raise
    return created


def destroy_segments(segments: Mapping[str, str]) -> None:
    for name in segments.values():
        unlink_segment(name)


def map_segment(name: str, *, writable: bool = True) -> mmap.mmap:
    """Map a segment of this run (a child's view of a `SegmentDecl`), without populating it."""
    flags = os.O_RDWR if writable else os.O_RDONLY
    try:
        fd = open_private(segment_path(name), flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"shared-memory segment {name!r} does not exist") from None
    try:
        size = os.fstat(fd).st_size
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return mmap.mmap(fd, size, access=access)
    finally:
        os.close(fd)
