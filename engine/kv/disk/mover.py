"""The disk tier's I/O, on a thread of its own: KV blocks from the cache to their files and back.

The cache is every rank's KV segment, seen as raw bytes (engine/kv/transfer/cache_view.py); a
block's file holds rank 0's part, then rank 1's, and so on. Bytes go straight between the cache
and the file (writev / readv over the block's pieces), so nothing is copied on the way, and the
CRC is computed over the same pieces. Loads go before spills: a request waits for a load, while a
spill only has to happen some time.

Orders come from the scheduler's event loop (`submit`); each one's event goes to `report`, called
on this thread (the actor hands it to its loop). An order that fails for an unexpected reason is
answered with its error and logged: its blocks go back to the scheduler either way.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from engine.kv.disk.block_file import BadBlockFile
from engine.kv.disk.config import KvDiskConfig
from engine.kv.disk.orders import (
    BlocksLoaded,
    BlocksSpilled,
    DiskEvent,
    DiskOrder,
    LoadBlocks,
    SpillBlocks,
)
from engine.kv.disk.store import DiskStore
from engine.kv.transfer.cache_view import CacheView

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0


class DiskMover:
    def __init__(
        self, store: DiskStore, views: Sequence[CacheView], report: Callable[[DiskEvent], None]
    ) -> None:
        self.store = store
        self.views = list(views)
        self._report = report
        self._loads: deque[LoadBlocks] = deque()
        self._spills: deque[SpillBlocks] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-disk", daemon=True)
        self._thread.start()

    def submit(self, orders: Sequence[DiskOrder]) -> None:
        with self._wake:
            for order in orders:
                if isinstance(order, LoadBlocks):
                    self._loads.append(order)
                else:
                    self._spills.append(order)
            self._wake.notify()

    def close(self) -> None:
        """Stop after the order under way (those queued are dropped: their process is ending)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(JOIN_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._closed or self._loads or self._spills):
                    self._wake.wait()
                if self._closed:
                    return
                order = self._loads.popleft() if self._loads else self._spills.popleft()
            self._report(self.run(order))

    def run(self, order: DiskOrder) -> DiskEvent:
        """Carry out one order; its event (also on the caller's thread: tests)."""
        if isinstance(order, LoadBlocks):
            return self.load(order)
        return self.spill(order)

    def block_parts(self, block_id: int) -> list[memoryview]:
        """The block's bytes in its file's order: every rank's pieces, rank 0 first."""
        return [part for view in self.views for part in view.chunks([block_id])]

    def spill(self, order: SpillBlocks) -> BlocksSpilled:
        written = written_bytes = evicted = 0
        error = None
        try:
            for block_id, key in order.blocks:
                outcome = self.store.write(key, self.block_parts(block_id))
                written += outcome.written > 0
                written_bytes += outcome.written
                evicted += outcome.evicted
        except Exception as exc:  # the blocks go back all the same
            log.exception("writing KV blocks to %s failed", self.store.directory)
            error = f"{type(exc).__name__}: {exc}"
        block_ids = [block_id for block_id, _ in order.blocks]
        return BlocksSpilled(block_ids, written, written_bytes, evicted, self.store.full, error)

    def load(self, order: LoadBlocks) -> BlocksLoaded:
        loaded = read = dropped = 0
        error = None
        for block_id, key in order.blocks:
            try:
                read += self.store.read_into(key, self.block_parts(block_id))
            except BadBlockFile as exc:
                log.warning("dropped the KV block file of %s: %s", key.hex(), exc)
                dropped += 1
                error = str(exc)
            except FileNotFoundError:
                error = f"block {key.hex()} is no longer on disk"
            except Exception as exc:
                log.exception("reading KV block %s failed", key.hex())
                error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                break
            loaded += 1
        return BlocksLoaded(order.load_id, loaded, read, dropped, error)


def open_mover(
    config: KvDiskConfig, buffers: Sequence[Any], report: Callable[[DiskEvent], None]
) -> DiskMover:
    """The tier `config` names over the ranks' cache `buffers` (their segments, mapped), its
    thread started. OSError if its directory cannot be used."""
    store = DiskStore(config.path, bytes.fromhex(config.namespace), config.max_bytes)
    views = [
        CacheView(layout, buffer) for layout, buffer in zip(config.layouts, buffers, strict=True)
    ]
    return DiskMover(store, views, report)
