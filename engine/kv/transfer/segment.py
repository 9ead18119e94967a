"""Mapping a same-host source's cache segment, named by its ShmGrant: only a segment of ours.

The name is a name, never a path: the engine's segment prefix, then letters, digits, '.', '_'
and '-' (no separator, so the file is directly in the shared-memory directory); opened without
following a link; a regular file of this user, exactly as large as the grant's layout says its
cache is. A grant that fails any of these is refused before anything is mapped.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from dataclasses import dataclass

from engine.messages.kv_transfer import KvLayout


@dataclass(frozen=True)
class Segments:
    """Where segments live and how their names start (the actor runtime's rules: its shm.py)."""

    directory: str
    prefix: str

    def check_name(self, name: str) -> None:
        pattern = rf"{re.escape(self.prefix)}[A-Za-z0-9_.-]{{1,200}}"
        if not re.fullmatch(pattern, name) or ".." in name:
            raise ValueError(
                f"the source's segment {name[:80]!r} is not a segment name ({self.prefix}... of "
                f"letters, digits, '.', '_' and '-' in {self.directory}, never a path)"
            )

    def exists(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.directory, name))

    def map_source(self, name: str, layout: KvLayout) -> mmap.mmap:
        """The segment, read-only; ValueError (nothing mapped) if it is not a cache of `layout`."""
        self.check_name(name)
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # a FIFO must not block
        try:
            descriptor = os.open(os.path.join(self.directory, name), flags)
        except OSError as exc:
            why = exc.strerror
            raise ValueError(f"the source's segment {name!r} cannot be opened: {why}") from None
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise ValueError(
                    f"the source's segment {name!r} is not a shared-memory file of ours"
                )
            if info.st_size != layout.segment_bytes:
                raise ValueError(
                    f"the source's segment {name!r} is {info.st_size} bytes, but a cache of its "
                    f"layout ({layout.num_blocks} blocks) takes {layout.segment_bytes}"
                )
            return mmap.mmap(descriptor, info.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(descriptor)
