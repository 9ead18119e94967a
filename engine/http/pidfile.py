"""server.pidfile: one root per pidfile, held with an flock for the root's whole life.

The lock, not the pid written in the file, is what counts: the kernel drops it when the root
dies however it dies, so a restarted root (systemd's Restart=on-failure) takes over a file its
killed predecessor left, while a second root started beside a live one is refused in one line
naming the holder. The file is removed at an orderly exit.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class PidFileBusy(OSError):
    """Another live process holds the pidfile; the message names it and its pid."""


class PidFile:
    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def hold(cls, path: str) -> PidFile:
        """Lock `path` (created if missing) and write our pid in it; PidFileBusy if held."""
        target = Path(path).expanduser()
        while True:
            try:
                fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise OSError(f"cannot open pidfile {target}: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                raise PidFileBusy(
                    f"pidfile {target} is held by another engine (pid {holder}); "
                    "stop it or choose another server.pidfile"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, target):
                break
            os.close(fd)  # its holder removed it as we locked it: lock the new file instead
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(target, fd)

    def release(self) -> None:
        """Remove the file, then drop the lock (idempotent)."""
        if self._fd < 0:
            return
        if _same_file(self._fd, self.path):
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = -1


def _read_pid(fd: int) -> str:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)
