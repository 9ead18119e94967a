"""A GGUF file's repacked weights kept on disk for every later start, mapped, never rebuilt.

Repacking a file's quantized tensors for the CPU kernel (engine/gguf/native_blocks.py) reads and
rearranges every byte of the file: seconds for a 1-2B model. What it gives depends only on the
file's content and on how the rank loads it, so the first start writes the rank's final tensors
(the weight store's format, engine/model/loading/weight_store.py) beside what is derived from
the file, in the directory named by its content hash ($ENGINE_HOME/gguf/<hash>-vN/:
engine/gguf/checkpoint.py), as `packed-<digest of the load's identity>.weights`; later starts,
and every restart, map it as llama.cpp maps its file: the pages are the page cache's, shared by
every process that maps them.

The file is written under a temporary name created exclusively (O_EXCL, owner-only) and renamed
into place whole. Before it is mapped it is checked (engine/runtime/private_files.py): reached
without following a link, a regular file, owned by this process's user, readable and writable by
it alone; one that is not is never mapped nor replaced (the start reads the GGUF file instead and
says why). Its index names what it holds (the identity): one holding other weights is refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from engine.model.loading.weight_store import LoadedWeights, StoreSlot
from engine.runtime.private_files import ForeignFileError, open_private

log = logging.getLogger(__name__)

PREFIX = "packed-"
SUFFIX = ".weights"
RUN = "on-disk"  # the index's run: files here outlive every run


class CacheSlot(StoreSlot):
    """One rank's repacked weights in `directory` (a prepared GGUF checkpoint's), for `identity`
    (what they depend on, in words: StoreSlot's)."""

    def __init__(self, directory: str | Path, identity: str) -> None:
        digest = hashlib.sha256(identity.encode()).hexdigest()[:20]
        self.directory = str(directory)
        self.path = os.path.join(directory, f"{PREFIX}{digest}{SUFFIX}")
        self.run = RUN
        self.identity = identity

    def _open(self) -> int | None:
        try:
            return open_private(self.path)
        except FileNotFoundError:
            return None
        except ForeignFileError as exc:
            log.warning("repacked weights not mapped: %s; the GGUF file is read instead", exc)
            return None

    def save(self, weights: LoadedWeights) -> LoadedWeights:
        """Store `weights` for later starts (unless something is at the name: it is never
        replaced) and return them mapped from it."""
        if os.path.lexists(self.path):
            return self.load() or weights
        log.info("repacked weights are written to %s for later starts (once)", self.path)
        return super().save(weights)

    def remove(self) -> None:
        """Kept: later starts map it (a rank stopped in order leaves it in place)."""
