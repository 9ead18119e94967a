"""The prefix cache's index kept where it outlives the scheduler: block id -> the key of the KV
the block holds (engine/kv/cache/prefix_cache.py), in a shared-memory segment of the run.

The workers' KV cache outlives a scheduler restart, but the scheduler's index of it does not; a
restarted scheduler reads this record to know which blocks hold which prefixes, so the requests
resubmitted to it find their KV instead of computing it again.

What makes the record safe to trust: the pool writes a block's key only once the KV behind it
is final (a block is indexed after the step that computed it came back, and never written
again while indexed), and clears it before the block can be handed out for other KV (eviction,
or the cache being forgotten). A scheduler killed mid-update leaves at worst a torn key, which
names no prefix (keys are 128-bit digests) and so is never a hit.

Layout: one KEY_BYTES slot per block, all zero for a block that holds nothing indexed.
"""

from __future__ import annotations

from collections.abc import Iterator

KEY_BYTES = 16  # prefix_cache.hash_block's digest size
_EMPTY = bytes(KEY_BYTES)
_PAGE_BYTES = 256 * KEY_BYTES


def prefix_index_bytes(num_blocks: int) -> int:
    """The size of the record for a pool of `num_blocks` blocks."""
    return num_blocks * KEY_BYTES


class PrefixIndex:
    """One slot per block of the pool, in `memory` (a writable buffer of prefix_index_bytes)."""

    def __init__(self, memory: memoryview | bytearray, num_blocks: int) -> None:
        view = memoryview(memory).cast("B")
        if len(view) < prefix_index_bytes(num_blocks):
            raise ValueError(
                f"a prefix index of {num_blocks} blocks needs {prefix_index_bytes(num_blocks)} "
                f"bytes, got {len(view)}"
            )
        self._slots = view[: prefix_index_bytes(num_blocks)]
        self.num_blocks = num_blocks

    def put(self, block_id: int, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a prefix key is {KEY_BYTES} bytes, got {len(key)}")
        start = block_id * KEY_BYTES
        self._slots[start : start + KEY_BYTES] = key

    def drop(self, block_id: int) -> None:
        start = block_id * KEY_BYTES
        self._slots[start : start + KEY_BYTES] = _EMPTY

    def drop_all(self) -> None:
        self._slots[:] = bytes(len(self._slots))

    def entries(self) -> Iterator[tuple[int, bytes]]:
        """(block id, key) of every indexed block, in block order."""
        data = bytes(self._slots)
        for page_start in range(0, len(data), _PAGE_BYTES):  # all-zero pages are skipped in C
            page = data[page_start : page_start + _PAGE_BYTES]
            if page.count(0) == len(page):
                continue
            for offset in range(0, len(page), KEY_BYTES):
                key = page[offset : offset + KEY_BYTES]
                if key != _EMPTY:
                    yield (page_start + offset) // KEY_BYTES, key
