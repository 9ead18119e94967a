"""The disk tier's files: one per KV block, in a directory per namespace, within a size bound.

    <tier>/<namespace hex>/<key hex>.kv      engine/kv/disk/block_file.py's format

The tier (`cache.kv_disk_path`) may be shared: every replica of a model on the host, every
model, every later start. So a file is only ever created whole and under a name nobody has: it
is written under a temporary name of its own (created exclusively, owner-only), then linked to
its final name, which fails if another writer got there first (their block is the same one).
What is read is checked on the open descriptor before a byte is used (engine/runtime/
private_files.py: not a link, a regular file, ours, mode 0600), then against its header and
checksum; a file that fails is removed and counted, never served.

The bound (`cache.kv_disk_size`) is kept least recently used first, over the whole tier: each
writer counts what it adds, and when its count passes the bound it lists the tier again (what the
other writers added included) and removes the files used longest ago until 90 % of the bound
remains. A read marks its file used (its modification time). With several writers the tier may
pass the bound by what the others wrote since they last listed it (at most a tenth of it each).

A full disk stops the writes (said once), and they are tried again a minute later; a directory
removed under the server is made again at the next write. Reads go on either way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Sequence
from typing import NamedTuple

from engine.kv.disk import block_file
from engine.kv.disk.block_file import HEADER_BYTES, BadBlockFile
from engine.runtime.private_files import (
    ForeignFileError,
    check_owned_tree,
    create_private,
    ensure_private_dir,
    open_private,
)

log = logging.getLogger(__name__)

FULL_RETRY_S = 60.0  # after a full disk, how long before writes are tried again
KEEP_AFTER_EVICTION = 0.9  # of the bound
STALE_TEMPORARY_S = 600.0  # a temporary file this old is a dead writer's
_FULL = (errno.ENOSPC, errno.EDQUOT)


class WriteOutcome(NamedTuple):
    written: int = 0  # bytes written (0: nothing was)
    present: bool = False  # the block was on disk already
    evicted: int = 0  # files removed to keep the bound


class DiskStore:
    """The tier at `root`, files of `namespace` (16 bytes), at most `max_bytes` in all."""

    def __init__(self, root: str, namespace: bytes, max_bytes: int) -> None:
        self.root = root
        self.namespace = namespace
        self.directory = os.path.join(root, namespace.hex())
        self.max_bytes = max_bytes
        self._full_since: float | None = None
        self._said_full = False
        self._make_directories()
        self._sweep_temporaries()
        self.used_bytes = sum(size for _, size, _ in self._listing())

    # ---- lookups -------------------------------------------------------------------------------

    def path(self, key: bytes) -> str:
        return os.path.join(self.directory, block_file.file_name(key))

    def contains(self, key: bytes) -> bool:
        """Whether a file for `key` is there (it is proven only when read)."""
        return os.path.lexists(self.path(key))

    # ---- writing -------------------------------------------------------------------------------

    def write(self, key: bytes, parts: Sequence[memoryview]) -> WriteOutcome:
        """Write block `key` (its payload in `parts`) unless it is there already or the disk is
        full; what was done. Nothing is written while the disk is full (for FULL_RETRY_S)."""
        path = self.path(key)
        if os.path.lexists(path):
            return WriteOutcome(present=True)
        if self._full_since is not None:
            if time.monotonic() - self._full_since < FULL_RETRY_S:
                return WriteOutcome()
            self._full_since = None
        head = block_file.header(self.namespace, key, parts)
        try:
            written = self._write_new(path, key, [head, *parts])
        except FileNotFoundError:  # the tier was removed under us: make it again, once
            self._make_directories()
            self.used_bytes = 0
            written = self._write_new(path, key, [head, *parts])
        if written == 0:
            return WriteOutcome(present=os.path.lexists(path))
        self._said_full = False
        self.used_bytes += written
        evicted = self._evict() if self.used_bytes > self.max_bytes else 0
        return WriteOutcome(written=written, evicted=evicted)

    def _write_new(self, path: str, key: bytes, parts: list[bytes | memoryview]) -> int:
        """Bytes written under `path`, or 0 if another writer was first or the disk is full."""
        temporary = os.path.join(
            self.directory, f".{key.hex()}.{os.getpid()}-{time.monotonic_ns()}.tmp"
        )
        fd = create_private(temporary, os.O_WRONLY)
        try:
            try:
                _write_all(fd, parts)
            finally:
                os.close(fd)
            return self._publish(temporary, path, sum(len(part) for part in parts))
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            self._note_full(exc)
            return 0
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)

    def _publish(self, temporary: str, path: str, size: int) -> int:
        """Give the finished file its name, unless a file has it already (theirs stays)."""
        try:
            os.link(temporary, path)
        except FileExistsError:
            return 0
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            os.rename(temporary, path)  # a file system without hard links: last writer wins
        return size

    def _note_full(self, exc: OSError) -> None:
        self._full_since = time.monotonic()
        if not self._said_full:
            self._said_full = True
            log.warning(
                "the KV disk tier at %s cannot grow (%s): KV blocks are not written to disk "
                "while it is full (tried again every %.0f s); the server goes on, and reads "
                "from the tier go on",
                self.root,
                exc.strerror,
                FULL_RETRY_S,
            )

    @property
    def full(self) -> bool:
        return self._full_since is not None

    # ---- reading -------------------------------------------------------------------------------

    def read_into(self, key: bytes, parts: Sequence[memoryview]) -> int:
        """Fill `parts` (writable, the payload's pieces in order) with block `key`'s payload;
        the bytes read. FileNotFoundError if there is none; BadBlockFile (the file removed) if
        the file may not be served, what is in `parts` then being garbage."""
        path = self.path(key)
        try:
            fd = open_private(path)
        except ForeignFileError as exc:
            self._remove(path)
            raise BadBlockFile(f"not ours: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            head = bytearray(HEADER_BYTES)
            expected = HEADER_BYTES + sum(len(part) for part in parts)
            if size == expected:
                _read_all(fd, [head, *parts])
            else:
                os.readv(fd, [head])
            block_file.check(head, self.namespace, key, parts, size)
            os.utime(fd)  # used now: the last to be evicted
        except BadBlockFile:
            self._remove(path)
            raise
        finally:
            os.close(fd)
        return size

    # ---- the bound -----------------------------------------------------------------------------

    def _evict(self) -> int:
        """Remove the files used longest ago, over the whole tier, until 90 % of the bound is
        left; how many were removed."""
        files = sorted(self._listing())
        used = sum(size for _, size, _ in files)
        keep = int(self.max_bytes * KEEP_AFTER_EVICTION)
        count = freed = 0
        for _, size, path in files:
            if used - freed <= keep:
                break
            if self._remove(path):
                count += 1
                freed += size
        self.used_bytes = used - freed
        return count

    def _listing(self) -> list[tuple[float, int, str]]:
        """(last used, bytes, path) of every block file of the tier, any namespace."""
        found = []
        for directory in _entries(self.root):
            if not directory.is_dir(follow_symlinks=False) or len(directory.name) != 32:
                continue
            for entry in _entries(directory.path):
                if block_file.key_of(entry.name) is None:
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    found.append((info.st_mtime, info.st_size, entry.path))
        return found

    # ---- upkeep --------------------------------------------------------------------------------

    def _make_directories(self) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        check_owned_tree(self.root)  # ours, and nobody else may add or remove names in it
        ensure_private_dir(self.directory)

    def _sweep_temporaries(self) -> None:
        """Remove what writers that died mid-write left (their temporaries, never published)."""
        now = time.time()
        for entry in _entries(self.directory):
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                try:
                    if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMPORARY_S:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    continue

    def _remove(self, path: str) -> bool:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except IsADirectoryError:  # never ours: an empty one goes, a full one stays unread
            with contextlib.suppress(OSError):
                os.rmdir(path)
        return True


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    pending = [memoryview(part).cast("B") for part in parts]
    while pending:
        written = os.writev(fd, pending[:1024])  # IOV_MAX
        while written and pending:
            if written >= len(pending[0]):
                written -= len(pending.pop(0))
            else:
                pending[0] = pending[0][written:]
                written = 0


def _read_all(fd: int, parts: Sequence[bytearray | memoryview]) -> None:
    """Fill `parts` from `fd`; BadBlockFile if the file ends first (it shrank under us)."""
    pending = [memoryview(part).cast("B") for part in parts]
    while pending:
        got = os.readv(fd, pending[:1024])
        if got == 0:
            raise BadBlockFile("torn: the file ended early")
        while got and pending:
            if got >= len(pending[0]):
                got -= len(pending.pop(0))
            else:
                pending[0] = pending[0][got:]
                got = 0
