"""Shared-memory rings: one writer, one reader (SPSC) or N readers (broadcast), msgspec frames.

Positions (`tail`: bytes ever published, `head`: bytes a reader ever consumed) only grow;
`position % capacity` is the offset in the data area and `tail - head` the bytes in flight. The
writer's free space is bounded by its slowest reader. The writer publishes the new tail only
after the whole record is in place, so a writer killed mid-write leaves nothing visible; a reader
advances its head only after copying the frames out. Layout and record format: `shm`; waiting
(spin, then park on a doorbell): `doorbell`.
"""

from __future__ import annotations

import mmap
import os
from array import array
from collections import deque
from collections.abc import Iterable, Sequence

from engine.messages.codec import FrameTooLarge
from engine.messages.rings import RECORD_OVERHEAD, RingSpec
from engine.runtime import shm
from engine.runtime.doorbell import (
    DEFAULT_MAX_SPIN_US,
    DEFAULT_WRITER_MAX_SPIN_US,
    Waiter,
    create_doorbell,
    default_doorbell_dir,
    doorbell_path,
    full_fence,
    open_doorbell,
    ring_doorbell,
    unlink_quietly,
)
from engine.runtime.private_files import ensure_private_dir
from engine.runtime.shm import run_prefix

__all__ = [
    "FrameTooLarge",
    "RingClosed",
    "RingCorrupted",
    "RingReader",
    "RingSpec",
    "RingWriter",
    "create_ring",
    "destroy_ring",
    "run_prefix",
    "sweep_stale_segments",
]


_DIRECT_COPY_BYTES = 64 * 1024  # records this big whose frames average
_DIRECT_COPY_MIN_FRAME = 8 * 1024  # this much are not joined before the copy


class RingClosed(RuntimeError):
    """The ring end was used after close()."""


class RingCorrupted(RuntimeError):
    """The shared positions or a record make no sense (memory scribbled on, or a wrong spec)."""


def _bell_paths(spec: RingSpec) -> tuple[str, list[str]]:
    writer = doorbell_path(spec.doorbell_dir, spec.name, "w")
    readers = [doorbell_path(spec.doorbell_dir, spec.name, f"r{i}") for i in range(spec.readers)]
    return writer, readers


def create_ring(spec: RingSpec) -> None:
    """Create the segment (mode 0600) and the doorbells of a new, empty ring."""
    ensure_private_dir(spec.doorbell_dir or default_doorbell_dir())
    shm.create_ring_segment(spec.name, spec.capacity, spec.readers)
    try:
        writer_bell, reader_bells = _bell_paths(spec)
        for path in (writer_bell, *reader_bells):
            unlink_quietly(path)  # a leftover of a crashed run with a recycled pid
            create_doorbell(path)
    except BaseException:
        destroy_ring(spec)
        raise


def destroy_ring(spec: RingSpec) -> None:
    """Unlink the segment and its doorbells; open ends keep working until closed. Idempotent."""
    shm.unlink_segment(spec.name)
    writer_bell, reader_bells = _bell_paths(spec)
    for path in (writer_bell, *reader_bells):
        unlink_quietly(path)


def sweep_stale_segments(
    doorbell_dirs: Iterable[str] | None = None, *, shm_dir: str = shm.SHM_DIR
) -> list[str]:
    """Remove our `engine-*` run directories (and older runs' loose segments) and doorbells
    whose run's root process is dead.

    Doorbells are looked for in `doorbell_dirs` (default: the default doorbell directory).
    Returns the names of the segments removed.
    """
    removed: list[str] = []
    for path in shm.stale_entries(shm_dir):
        if shm.remove_entry(path):
            removed.append(os.path.basename(path))
    for directory in [default_doorbell_dir()] if doorbell_dirs is None else doorbell_dirs:
        for path in shm.stale_entries(directory, suffix=".bell"):
            unlink_quietly(path)
    return sorted(removed)


def _close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)


def _open_doorbells(paths: Sequence[str], memory: shm.RingMemory) -> list[int]:
    """Open every doorbell, or close what was opened (and the mapping) and raise."""
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(open_doorbell(path))
    except BaseException:
        _close_fds(fds)
        memory.close()
        raise
    return fds


def _corrupted(spec: RingSpec, what: str) -> RingCorrupted:
    return RingCorrupted(f"ring {spec.name!r}: {what}")


class RingWriter:
    """The single writing end of a ring. Not thread-safe; use from one thread (one loop)."""

    def __init__(self, spec: RingSpec, *, max_spin_us: float = DEFAULT_WRITER_MAX_SPIN_US) -> None:
        self.spec = spec
        self._map = shm.RingMemory(spec.name, spec.capacity, spec.readers)
        self._segment: mmap.mmap = self._map.segment
        self._words = self._map.words
        self._data = self._map.data
        self._capacity = spec.capacity
        self._tail: int = self._words[shm.W_TAIL]
        self._head_words = [shm.w_head(i) for i in range(spec.readers)]
        self._parked_words = [shm.w_parked(i) for i in range(spec.readers)]
        self._known_head = self._slowest_head()
        writer_bell, reader_bells = _bell_paths(spec)
        self._bells = _open_doorbells([writer_bell, *reader_bells], self._map)
        self.doorbell_fd = self._bells[0]  # rung by readers when space frees up
        self._reader_bells = self._bells[1:]
        self._space_waiters = 0
        self._waiter = Waiter(max_spin_us)
        self._closed = False

    def _slowest_head(self) -> int:
        words = self._words
        head: int = min(words[w] for w in self._head_words)
        if not 0 <= self._tail - head <= self._capacity:
            raise _corrupted(self.spec, f"tail {self._tail} and slowest head {head} are apart")
        return head

    def fill(self) -> float:
        """Fraction of the data area its slowest reader has not read yet (0 to 1). Read-only,
        so the busy-beat thread may call it while the loop writes."""
        words = self._words
        head = min(words[w] for w in self._head_words)
        return min(max(self._tail - head, 0), self._capacity) / self._capacity

    def free_bytes(self) -> int:
        """Room for records right now (re-reads the readers' heads)."""
        self._check_open()
        self._known_head = self._slowest_head()
        return self._capacity - (self._tail - self._known_head)

    def try_send_many(self, frames: Sequence[bytes], *, quiet: bool = False) -> int:
        """Write as many leading frames as fit, as one record; returns how many (maybe 0).
        `quiet`: ring no doorbell (a parked reader finds the frames at its next safety recheck
        or read): for frames nobody waits for, such as heartbeats."""
        self._check_open()
        if not frames:
            return 0
        lengths = [len(frame) for frame in frames]
        biggest = max(lengths)
        if biggest > self.spec.max_frame_bytes:
            raise FrameTooLarge(
                f"frame of {biggest} bytes can never fit in ring {self.spec.name!r} of capacity "
                f"{self._capacity} bytes (at most {self.spec.max_frame_bytes} bytes per frame)"
            )
        count = len(frames)
        size = 4 + 4 * count + sum(lengths)
        free = self._capacity - (self._tail - self._known_head)
        if size > free:
            free = self.free_bytes()
            if size > free:
                count = shm.frames_that_fit(lengths, free)
                if count == 0:
                    return 0
                frames, lengths = frames[:count], lengths[:count]
                size = 4 + 4 * count + sum(lengths)
        header: list[bytes | array[int]] = [shm.COUNT.pack(count), array("I", lengths)]
        if size < _DIRECT_COPY_BYTES or count * _DIRECT_COPY_MIN_FRAME > size:
            self._copy_in(self._tail, b"".join([*header, *frames]))  # one copy into the ring
        else:  # a few big frames: copy each straight in rather than joining them first
            position = self._tail
            for piece in (b"".join(header), *frames):
                self._copy_in(position, piece)
                position += len(piece)
        self._publish(self._tail + size, quiet)
        return count

    def _copy_in(self, position: int, piece: bytes) -> None:
        size = len(piece)
        offset = position % self._capacity
        start = self._data + offset
        if offset + size <= self._capacity:
            self._segment[start : start + size] = piece
        else:  # straddles the end of the data area
            first = self._capacity - offset
            with memoryview(piece) as view:
                self._segment[start : start + first] = view[:first]
                self._segment[self._data : self._data + size - first] = view[first:]

    def _publish(self, tail: int, quiet: bool = False) -> None:
        self._tail = tail
        words = self._words
        full_fence()  # the record's bytes before the tail that makes them visible
        words[shm.W_TAIL] = self._tail
        if quiet:
            return
        full_fence()  # tail stored before the parked flags are loaded (lost-wakeup race)
        for reader, parked_word in enumerate(self._parked_words):
            if words[parked_word]:
                ring_doorbell(self._reader_bells[reader])

    async def send(self, frame: bytes) -> None:
        """Write one frame, waiting (without blocking the loop) while the ring is full."""
        await self.send_many((frame,))

    async def send_many(self, frames: Sequence[bytes]) -> None:
        """Write every frame in order, as few records as the free space allows; never drops."""
        sent = self.try_send_many(frames)
        while sent < len(frames):
            await self._waiter.wait((_SpaceWanted(self, RECORD_OVERHEAD + len(frames[sent])),))
            sent += self.try_send_many(frames[sent:])

    def close(self) -> None:
        """Release this end (waiting sends are woken and fail with RingClosed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._waiter.interrupt()
        if self._space_waiters:
            self._words[shm.W_WRITER_WAITING] = 0
        _close_fds(self._bells)
        self._map.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RingClosed(f"writer of ring {self.spec.name!r} is closed")

    def _set_waiting(self, waiting: bool) -> None:
        self._space_waiters += 1 if waiting else -1
        self._words[shm.W_WRITER_WAITING] = 1 if self._space_waiters else 0

    def __enter__(self) -> RingWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _SpaceWanted:
    """A writer waiting until `needed` bytes are free (a Parkable for the Waiter)."""

    def __init__(self, writer: RingWriter, needed: int) -> None:
        self.writer = writer
        self.needed = needed
        self.doorbell_fd = writer.doorbell_fd

    def ready(self) -> bool:
        return self.writer.free_bytes() >= self.needed

    def set_parked(self, parked: bool) -> None:
        if not self.writer._closed:
            self.writer._set_waiting(parked)


class RingReader:
    """One reading end of a ring (reader index `reader` of a broadcast ring).

    Also a Parkable: a Mailbox waits on many readers at once through `ready`, `set_parked` and
    `doorbell_fd`. Not thread-safe; use from one thread (one loop).
    """

    def __init__(
        self, spec: RingSpec, reader: int = 0, *, max_spin_us: float = DEFAULT_MAX_SPIN_US
    ) -> None:
        if not (isinstance(reader, int) and 0 <= reader < spec.readers):
            raise ValueError(
                f"reader index must be 0..{spec.readers - 1} for ring {spec.name!r}, got {reader!r}"
            )
        self.spec = spec
        self.reader = reader
        self._map = shm.RingMemory(spec.name, spec.capacity, spec.readers)
        self._segment: mmap.mmap = self._map.segment
        self._words = self._map.words
        self._data = self._map.data
        self._capacity = spec.capacity
        self._head_word = shm.w_head(reader)
        self._parked_word = shm.w_parked(reader)
        self._head: int = self._words[self._head_word]
        writer_bell, reader_bells = _bell_paths(spec)
        # doorbell_fd is rung when frames arrive; the space bell wakes a writer waiting for room
        self.doorbell_fd, self._space_bell = _open_doorbells(
            [reader_bells[reader], writer_bell], self._map
        )
        self._pending: deque[bytes] = deque()  # drained but not yet handed out by recv()
        self._parkers = 0
        self._waiter = Waiter(max_spin_us)
        self._closed = False

    def ready(self) -> bool:
        """True when frames are waiting (a cheap check that consumes nothing)."""
        return bool(self._pending) or self._words[shm.W_TAIL] != self._head

    def set_parked(self, parked: bool) -> None:
        if self._closed:
            return
        self._parkers += 1 if parked else -1
        self._words[self._parked_word] = 1 if self._parkers else 0

    def drain(self) -> list[bytes]:
        """Every complete frame available now, in order (maybe none); never waits."""
        if self._closed:
            raise RingClosed(f"reader {self.reader} of ring {self.spec.name!r} is closed")
        frames = list(self._pending)
        self._pending.clear()
        words = self._words
        tail: int = words[shm.W_TAIL]
        head = self._head
        if tail == head:
            return frames
        used = tail - head
        if not 0 < used <= self._capacity:
            raise _corrupted(self.spec, f"reader {self.reader} head {head} and tail {tail} apart")
        full_fence()  # the tail load before the loads of the bytes it covers
        offset = head % self._capacity
        start = self._data + offset
        try:
            if offset + used <= self._capacity:  # contiguous: slice frames out of the map
                shm.split_records(self._segment, start, start + used, frames)
            else:
                copied = self._segment[start : self._data + self._capacity]
                copied += self._segment[self._data : self._data + used - len(copied)]
                shm.split_records(copied, 0, used, frames)
        except ValueError as exc:
            raise _corrupted(self.spec, f"reader {self.reader}: {exc}") from None
        self._head = tail
        words[self._head_word] = tail
        full_fence()  # head stored before the writer's waiting flag is loaded
        if words[shm.W_WRITER_WAITING]:
            ring_doorbell(self._space_bell)
        return frames

    async def recv_many(self) -> list[bytes]:
        """Wait until at least one frame is available; return all that are."""
        while True:
            frames = self.drain()
            if frames:
                return frames
            await self._waiter.wait((self,))

    async def recv(self) -> bytes:
        """Wait for the next single frame."""
        if not self._pending:
            self._pending.extend(await self.recv_many())
        return self._pending.popleft()

    def close(self) -> None:
        """Release this end (a waiting recv is woken and fails with RingClosed). Idempotent."""
        if self._closed:
            return
        self._waiter.interrupt()
        if self._parkers:
            self._words[self._parked_word] = 0
        self._closed = True
        _close_fds((self.doorbell_fd, self._space_bell))
        self._map.close()

    def __enter__(self) -> RingReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
