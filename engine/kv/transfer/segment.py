"""Mapping a same-host source's cache segment, named by its ShmGrant: only a segment of ours.

The name is a name, never a path: a run directory of the engine (`engine-<pid>-<token>`), '/',
then letters, digits, '.', '_' and '-' (engine/runtime/shm.py). The directory is opened without
following a link and must be ours with mode 0700; the segment in it is opened without following
a link, and must be a regular file of this user with mode 0600, exactly as large as the grant's
layout says its cache is. A grant that fails any of these is refused before anything is mapped.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from dataclasses import dataclass

from engine.messages.kv_transfer import KvLayout
from engine.runtime.private_files import open_private


@dataclass(frozen=True)
class Segments:
    """Where segments live and how their names start (the actor runtime's rules: its shm.py)."""

    directory: str
    prefix: str

    def check_name(self, name: str) -> None:
        pattern = rf"{re.escape(self.prefix)}[0-9]+-[0-9a-f]+/[A-Za-z0-9_.-]{{1,200}}"
        if not re.fullmatch(pattern, name) or ".." in name:
            raise ValueError(
                f"the source's segment {name[:80]!r} is not a segment name ({self.prefix}<pid>-"
                f"<token>/ then letters, digits, '.', '_' and '-', in {self.directory}, never a "
                "path)"
            )

    def exists(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.directory, name))

    def map_source(self, name: str, layout: KvLayout) -> mmap.mmap:
        """The segment, read-only; ValueError (nothing mapped) if it is not a cache of `layout`."""
        self.check_name(name)
        descriptor = self._open(name)
        try:
            info = os.fstat(descriptor)
            if info.st_size != layout.segment_bytes:
                raise ValueError(
                    f"the source's segment {name!r} is {info.st_size} bytes, but a cache of its "
                    f"layout ({layout.num_blocks} blocks) takes {layout.segment_bytes}"
                )
            return mmap.mmap(descriptor, info.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(descriptor)

    def _open(self, name: str) -> int:
        """The segment's descriptor, read-only, through its checked run directory."""
        run_dir, _, file = name.partition("/")
        try:
            directory = open_private(
                os.path.join(self.directory, run_dir), os.O_RDONLY | os.O_DIRECTORY, stat.S_IFDIR
            )
            try:
                return open_private(file, os.O_RDONLY, dir_fd=directory)
            finally:
                os.close(directory)
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise ValueError(f"the source's segment {name!r} cannot be opened: {why}") from None
