"""Whether the shared-memory filesystem can hold what a run puts there, checked before anything is
created.

Rings and segments are files on a tmpfs (/dev/shm), made with ftruncate and never populated up
front: creating one larger than the free space succeeds, and the first write to a page the
tmpfs cannot back kills the writing process with SIGBUS. For a KV cache segment that is a worker
on its first KV write, long after the start looked fine, and again after every restart. So a
run's bytes (each ring's header and data, each child's control and status rings, each segment)
are compared with the free space at start, and a run that cannot fit is refused in one line
naming both figures and what to lower.

Segments of other live runs are sparse too: the space they have claimed but not yet touched is
not in the filesystem's "used" figure, so it is taken off the free space here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.runtime.child_process import CONTROL_RING_BYTES
from engine.runtime.child_spec import SupervisorSpec
from engine.runtime.shm import SEGMENT_PREFIX, SHM_DIR, header_bytes

BLOCK_BYTES = 512  # st_blocks counts 512-byte units on Linux, whatever the filesystem's block


class ShmSpaceError(RuntimeError):
    """The run's shared memory does not fit; the message names both figures."""


@dataclass(frozen=True)
class ShmNeed:
    rings: int  # bytes: ring headers and data areas, control rings included
    segments: int  # bytes: every SegmentDecl

    @property
    def total(self) -> int:
        return self.rings + self.segments


def shm_need(specs: Iterable[SupervisorSpec]) -> ShmNeed:
    """The bytes the runs of `specs` (one per replica) create in shared memory at start."""
    rings = segments = 0
    control = 2 * (header_bytes(1) + CONTROL_RING_BYTES)  # each child's control + status ring
    for spec in specs:
        rings += sum(header_bytes(len(r.readers)) + r.capacity for r in spec.rings)
        rings += control * len(spec.children)
        segments += sum(segment.size for segment in spec.segments)
    return ShmNeed(rings, segments)


def shm_free(directory: str = SHM_DIR) -> int:
    """Bytes still free for an unprivileged writer on `directory`'s filesystem, less what other
    runs' segments there have claimed and not yet touched."""
    stat = os.statvfs(directory)
    return max(0, stat.f_bavail * stat.f_frsize - claimed_untouched(directory))


def claimed_untouched(directory: str) -> int:
    """Bytes engine segments in `directory` (loose, or in run directories) have claimed and not
    yet touched."""
    claimed = 0
    for entry in _entries(directory):
        if not entry.name.startswith(SEGMENT_PREFIX):
            continue
        if entry.is_dir(follow_symlinks=False):  # unreadable (another user's): no entries
            claimed += sum(_untouched(inner) for inner in _entries(entry.path))
        else:
            claimed += _untouched(entry)
    return claimed


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError:
        return []


def _untouched(entry: os.DirEntry[str]) -> int:
    try:
        stat = entry.stat(follow_symlinks=False)
    except OSError:
        return 0
    return max(0, stat.st_size - stat.st_blocks * BLOCK_BYTES)


def check_shm_space(
    need: ShmNeed, free: int, *, directory: str = SHM_DIR, remedy: Sequence[str] = ()
) -> None:
    """ShmSpaceError, in one line, when `need` does not fit in `free` bytes of `directory`."""
    if need.total <= free:
        return
    parts = f"segments {_size(need.segments)}, rings {_size(need.rings)}"
    fixes = " or ".join([*remedy, f"enlarge {directory}"])
    raise ShmSpaceError(
        f"{directory} has {_size(free)} free but this run needs {_size(need.total)} of shared "
        f"memory there ({parts}); {fixes}"
    )


def require_shm_space(specs: Iterable[SupervisorSpec], remedy: Sequence[str] = ()) -> None:
    """check_shm_space for the runs of `specs` against what /dev/shm has free now."""
    check_shm_space(shm_need(specs), shm_free(), remedy=remedy)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
