"""Recording what the server served: `--record-trace FILE` appends one line per finished request.

The serving path only collects references (token ids and delivery times per choice) and hands a
finished `TraceRecord` to a queue; a writer thread encodes and writes it. Nothing on the event
loop touches the file, so a slow disk never delays a response. A write that fails (a full disk,
a vanished mount) stops recording with one log line; serving goes on. If the writer falls behind
by more than `max_pending` records, new ones are dropped (counted, logged once) rather than
letting memory grow.

The file is held under a shared lock (flock) while it is recorded into: `engine replay` refuses a
trace that a server is still recording, which would otherwise append the replay to the file
being replayed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import stat
import threading
from typing import IO

import msgspec

from engine.trace.format import TraceRecord

log = logging.getLogger("engine.trace")

_STOP = None  # queued by close(): the writer drains what came before and exits


class TraceRecorder:
    """Appends records to a JSON Lines file from a background thread."""

    def __init__(
        self, path: str, *, max_pending: int = 10_000, deterministic: bool = False
    ) -> None:
        self.path = path
        self.deterministic = deterministic  # stamped on every record
        self.written = 0
        self.dropped = 0
        self._queue: queue.Queue[TraceRecord | None] = queue.Queue(maxsize=max_pending)
        self._file: IO[bytes] | None = None
        self._failed = False
        self._warned_full = False
        try:
            fd = _open_owner_only(path)
            self._file = os.fdopen(fd, "ab")  # owned by the writer thread
        except OSError as e:
            self._stop_recording(f"cannot open {path}: {e}")
        self._thread = threading.Thread(target=self._write_loop, name="trace-writer", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        """False once recording has stopped (a write failed or the file could not be opened)."""
        return not self._failed

    def submit(self, record: TraceRecord) -> None:
        """Queue one record; never blocks, never raises."""
        if self._failed:
            self.dropped += 1
            return
        record.deterministic = self.deterministic
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if not self._warned_full:
                self._warned_full = True
                log.warning(
                    "trace writer is %d records behind; dropping records until it catches up",
                    self._queue.maxsize,
                )

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then close the file (waits at most `timeout` seconds)."""
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=timeout)
        self._thread.join(timeout)

    def _write_loop(self) -> None:
        encoder = msgspec.json.Encoder()
        buffer = bytearray()
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < 1024:
                    batch.append(self._queue.get_nowait())
            buffer.clear()
            for record in batch:
                if record is _STOP:
                    stopping = True
                    continue
                _append_line(encoder, record, buffer)
            if buffer and self._file is not None and not self._failed:
                try:
                    self._file.write(buffer)
                    self._file.flush()
                    self.written += len(batch) - stopping
                except OSError as e:
                    self.dropped += len(batch) - stopping
                    self._stop_recording(f"cannot write {self.path}: {e}")
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()

    def _stop_recording(self, why: str) -> None:
        self._failed = True
        log.error("trace recording stopped: %s (serving continues)", why)
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def being_recorded(path: str) -> bool:
    """Whether a recorder (of any process) holds `path` open to append to it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the probe's own lock
    return False


def _open_owner_only(path: str) -> int:
    """`path` opened for appending, owner-only (0600): a trace holds every prompt and output.
    The mode is set on the open file, so neither the umask (which could leave 0400, or with the
    default, 0644 on a file created before) nor an earlier run's looser mode decides it. A file
    owned by another user keeps its mode (only its owner may change it). Held under a shared
    lock until it is closed (being_recorded)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        info = os.fstat(fd)
        if (
            stat.S_ISREG(info.st_mode)
            and info.st_uid == os.geteuid()
            and stat.S_IMODE(info.st_mode) != 0o600
        ):
            os.fchmod(fd, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # a replay's probe holds its own for an instant only
    except OSError:
        os.close(fd)
        raise
    return fd


def _append_line(encoder: msgspec.json.Encoder, record: TraceRecord, buffer: bytearray) -> None:
    # A body a client sent pretty-printed holds newlines, which would split the line. JSON
    # strings cannot hold raw CR/LF, so every such byte is whitespace and may become a space.
    body = bytes(record.body)
    if b"\n" in body or b"\r" in body:
        record.body = msgspec.Raw(body.replace(b"\r", b" ").replace(b"\n", b" "))
    encoder.encode_into(record, buffer, -1)
    buffer.extend(b"\n")
