"""Shared-memory segments for rings: owner-only files in /dev/shm, mapped with mmap.

Why not `multiprocessing.shared_memory.SharedMemory`: on Python 3.11 every SharedMemory, also one
that merely attaches, registers the segment with its process's resource_tracker, which unlinks
it when that process exits and warns about a "leaked" segment. A ring outlives the processes
that use it (a restarted actor reattaches by name) and its life belongs to the supervisor
(`create_ring` / `destroy_ring` / `sweep_stale_segments`), so we use the same POSIX shared-memory
objects directly: on Linux `shm_open(NAME)` is `open("/dev/shm/NAME")`, and mapping that file is
what SharedMemory does, minus the tracker.

Names carry their run: `engine-<root pid>-<random>-<ring>`; a later run sweeps segments whose
root process is gone.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "engine-"
MAX_NAME_CHARS = 200  # NAME_MAX is 255; doorbells add a suffix to the ring's name
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_OWNER_PID_RE = re.compile(r"engine-(\d+)-")


def run_prefix(root_pid: int | None = None) -> str:
    """`engine-<pid>-<random>-`: the name prefix of every segment of one run."""
    pid = os.getpid() if root_pid is None else root_pid
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ValueError(f"root_pid must be a positive process id, got {root_pid!r}")
    return f"{SEGMENT_PREFIX}{pid}-{secrets.token_hex(2)}-"


def validate_name(name: str) -> None:
    if not (isinstance(name, str) and _NAME_RE.fullmatch(name) and len(name) <= MAX_NAME_CHARS):
        raise ValueError(
            f"ring name must be 1-{MAX_NAME_CHARS} characters of letters, digits, '.', '_' or "
            f"'-', starting with a letter or digit (e.g. 'engine-4242-a1b2-tok2sched'); "
            f"got {name!r}"
        )


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def create_segment(name: str, size: int) -> mmap.mmap:
    """Create a new owner-only segment of `size` zero bytes and map it."""
    try:
        fd = os.open(segment_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise FileExistsError(
            f"shared-memory segment {name!r} already exists: ring names must be unique per run"
        ) from None
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except BaseException:
        os.unlink(segment_path(name))
        raise
    finally:
        os.close(fd)  # the mapping stays valid without the descriptor


def open_segment(name: str, size: int) -> mmap.mmap:
    """Map an existing segment, which must be exactly `size` bytes."""
    try:
        fd = os.open(segment_path(name), os.O_RDWR | os.O_CLOEXEC)
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
