"""What a ring keeps in shared memory: the segment file, its header layout, the record format.

Segments are owner-only files in /dev/shm, mapped with mmap. Why not
`multiprocessing.shared_memory.SharedMemory`: on Python 3.11 every SharedMemory, also one that
merely attaches, registers the segment with its process's resource_tracker, which unlinks it
when that process exits and warns about a "leaked" segment. A ring outlives the processes that
use it (a restarted actor reattaches by name) and its life belongs to the supervisor
(`create_ring` / `destroy_ring` / `sweep_stale_segments`), so we use the same POSIX
shared-memory objects directly: on Linux `shm_open(NAME)` is `open("/dev/shm/NAME")`, and
mapping that file is what SharedMemory does, minus the tracker.

Every local user can create names in /dev/shm and list them, so a run keeps its segments in a
directory of its own, `engine-<root pid>-<token>/` (mode 0700, made exclusively; <token> is 64
random bits, drawn again should someone else hold the name), where nobody else can create,
replace or link anything. Segment names are paths below /dev/shm, `<run directory>/<random>-<ring>`
(one random part per supervisor); a later run sweeps the directory a crashed one left, by its pid.
Segments are created exclusively and checked when opened (engine/runtime/private_files.py).

Header: native 64-bit words; the hot ones each get their own 128-byte slot (a cache line plus
the neighbour the adjacent-line prefetcher pulls in with it), so the writer's stores never
invalidate the line a reader polls, and vice versa:

    slot 0          magic, capacity, readers                  (written once, at creation)
    slot 1          tail            - bytes ever published    (writer)
    slot 2          writer waiting  - writer parked for space (writer)
    slot 3 + 2i     head of reader i - bytes ever consumed    (reader i)
    slot 4 + 2i     reader i parked - waiting for frames      (reader i)
    data            `capacity` bytes, used as a circular byte stream

Every word has exactly one writing process and aligned 8-byte stores are atomic, so no lock is
shared between processes.

Records: a write is one record, `count:u32, length:u32 * count, payloads` (native byte order:
both ends share one machine), which may straddle the end of the data area. One record per batch
keeps the per-frame Python work to a `len`, a join and a slice.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
from collections.abc import Sequence
from functools import lru_cache

from engine.runtime.private_files import (
    ForeignFileError,
    TakenNameError,
    check_private,
    create_private,
    make_private_dir,
    open_private,
)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "engine-"
_OWNER_PID_RE = re.compile(r"engine-(\d+)-")
_RUN_DIR_RE = re.compile(r"engine-\d+-[0-9a-f]{16}")
_NAME_TRIES = 8  # random names drawn before giving up: each draw is 64 bits

_run_directory = ""  # this process's run directory (a name in SHM_DIR), once made


def run_directory() -> str:
    """`engine-<pid>-<token>`: this process's run directory in SHM_DIR, made (mode 0700) on
    first use and again after `release_run_directory`; a name someone else took is skipped."""
    global _run_directory
    if _run_directory and _is_our_directory(segment_path(_run_directory)):
        return _run_directory
    for _ in range(_NAME_TRIES):
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            make_private_dir(segment_path(name))
        except TakenNameError:
            continue
        _run_directory = name
        return name
    raise TakenNameError(f"{_NAME_TRIES} random run directories in {SHM_DIR} were all taken")


def current_run_directory() -> str:
    """This process's run directory, "" when it has none now."""
    return _run_directory


def release_run_directory() -> None:
    """Remove this process's run directory if nothing is left in it (else keep it)."""
    global _run_directory
    if _run_directory:
        with contextlib.suppress(OSError):  # not empty: another supervisor of the root's
            os.rmdir(segment_path(_run_directory))
            _run_directory = ""


def _is_our_directory(path: str) -> bool:
    try:
        check_private(os.lstat(path), path, stat.S_IFDIR)
    except (OSError, ForeignFileError):
        return False
    return True


def run_prefix() -> str:
    """`<run directory>/<random>-`: the name prefix of one supervisor's segments."""
    return f"{run_directory()}/{secrets.token_hex(4)}-"


def run_directory_of(name: str) -> str:
    """The run directory a segment name (`<run directory>/...`) lives in."""
    return name.partition("/")[0]


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def create_segment(name: str, size: int) -> mmap.mmap:
    """Create a new owner-only segment of `size` zero bytes and map it."""
    fd = create_private(segment_path(name))
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except BaseException:
        os.unlink(segment_path(name))
        raise
    finally:
        os.close(fd)  # the mapping stays valid without the descriptor


def open_segment(name: str, size: int) -> mmap.mmap:
    """Map an existing segment of ours, which must be exactly `size` bytes."""
    try:
        fd = open_private(segment_path(name), os.O_RDWR)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared-memory segment {name!r} does not exist: create_ring must run first, and "
            "destroy_ring must not have run yet"
        ) from None
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ValueError(
                f"shared-memory segment {name!r} is {actual} bytes, expected {size} for its "
                "RingSpec: the spec does not match the ring that was created"
            )
        return _map(fd, size)
    finally:
        os.close(fd)


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE maps every page now rather than on first touch inside the hot loops.
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def unlink_segment(name: str) -> bool:
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        return False
    return True


def owner_pid(name: str) -> int | None:
    """The root pid a segment (or doorbell) name was made for, or None if not one of ours."""
    match = _OWNER_PID_RE.match(name)
    return int(match.group(1)) if match else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def stale(name: str, path: str) -> bool:
    """True for our own entry of a run whose root process no longer exists."""
    pid = owner_pid(name)
    if pid is None or pid == os.getpid() or pid_alive(pid):
        return False
    try:
        return os.lstat(path).st_uid == os.getuid()
    except FileNotFoundError:
        return False


def remove_entry(path: str) -> bool:
    """Remove a stale entry: a run directory with what it holds, or a file (never a link's
    target); False if it was gone."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return False
    return True


# -- header layout ---------------------------------------------------------------------------

SLOT_WORDS = 16  # 128 bytes
MAGIC = int.from_bytes(b"engring1", "little")
W_MAGIC, W_CAPACITY, W_READERS = 0, 1, 2
W_TAIL = 1 * SLOT_WORDS
W_WRITER_WAITING = 2 * SLOT_WORDS


def w_head(reader: int) -> int:
    return (3 + 2 * reader) * SLOT_WORDS


def w_parked(reader: int) -> int:
    return (4 + 2 * reader) * SLOT_WORDS


def header_bytes(readers: int) -> int:
    return (3 + 2 * readers) * SLOT_WORDS * 8


def create_ring_segment(name: str, capacity: int, readers: int) -> None:
    """Create the segment of a new, empty ring (all positions zero)."""
    header = header_bytes(readers)
    segment = create_segment(name, header + capacity)
    with segment, memoryview(segment) as raw, raw[:header].cast("Q") as words:
        words[W_CAPACITY] = capacity
        words[W_READERS] = readers
        words[W_MAGIC] = MAGIC


class RingMemory:
    """One process's mapping of a ring segment, checked against what its spec says."""

    def __init__(self, name: str, capacity: int, readers: int) -> None:
        header = header_bytes(readers)
        self.segment = open_segment(name, header + capacity)
        self.words = memoryview(self.segment)[:header].cast("Q")
        found = (self.words[W_MAGIC], self.words[W_CAPACITY], self.words[W_READERS])
        if found != (MAGIC, capacity, readers):
            self.close()
            raise ValueError(
                f"segment {name!r} holds (magic, capacity, readers) = {found}, expected "
                f"({MAGIC}, {capacity}, {readers}) from its RingSpec"
            )
        self.data = header  # offset of the data area in the segment

    def close(self) -> None:
        self.words.release()
        self.segment.close()


# -- records ---------------------------------------------------------------------------------

COUNT = struct.Struct("=I")


def frames_that_fit(lengths: Sequence[int], free: int) -> int:
    """How many leading frames one record can carry in `free` bytes."""
    used = 4
    for count, length in enumerate(lengths):
        used += 4 + length
        if used > free:
            return count
    return len(lengths)


def split_records(source: bytes | mmap.mmap, start: int, end: int, out: list[bytes]) -> None:
    """Append the frames of the records in source[start:end] to `out`; ValueError if torn.

    A plain loop with `out.append` bound once: each frame goes straight into `out`, where
    map/slice or comprehension variants would build an intermediate list or call a function per
    frame, on the path of every message received.
    """
    append = out.append
    while start < end:
        (count,) = COUNT.unpack_from(source, start)
        offset = start + 4 + 4 * count
        if offset > end:
            raise ValueError(f"a record of {count} frames overruns the published bytes")
        for length in _lengths_struct(count).unpack_from(source, start + 4):
            append(source[offset : offset + length])
            offset += length
        if offset > end:
            raise ValueError(f"a record of {offset - start} bytes overruns the published bytes")
        start = offset


@lru_cache(maxsize=1024)
def _lengths_struct(count: int) -> struct.Struct:
    return struct.Struct(f"={count}I")


def stale_entries(directory: str, suffix: str = "") -> list[str]:
    """Paths in `directory` named `engine-<dead root pid>-…<suffix>` that we own."""
    try:
        entries = os.scandir(directory)
    except FileNotFoundError:
        return []
    with entries:
        return [
            entry.path
            for entry in entries
            if entry.name.startswith(SEGMENT_PREFIX)
            and entry.name.endswith(suffix)
            and (not entry.is_dir(follow_symlinks=False) or _is_run_directory(entry))
            and stale(entry.name, entry.path)
        ]


def _is_run_directory(entry: os.DirEntry[str]) -> bool:
    """A run directory of ours (another directory named like one is left alone: it is not)."""
    return bool(_RUN_DIR_RE.fullmatch(entry.name)) and _is_our_directory(entry.path)
