"""One rank's KV cache, seen through numpy as raw bytes, and block copies between such views.

The bytes are laid out as `KvLayout` says: `[num_layers, 2 (K, V), num_slots + 1, slot_bytes]`
with `num_slots = num_blocks * block_size`, so block `b` of one layer's K (or V) is the slots
`[b * block_size, (b + 1) * block_size)`: `chunk_bytes` contiguous bytes. Views are of uint8
whatever the cache's dtype (numpy has no bfloat16, and a copy never needs to know).

Copies are made large on purpose: a run of consecutive block ids (on both sides, for a
cache-to-cache copy) moves as one strided numpy copy spanning every layer's K and V, and a
socket moves a run per (layer, K/V) as one buffer. The byte stream of a transfer over a socket
is, for each layer, K then V, the chunks of the blocks in the order they are named; both ends
cut it into their own runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.messages.kv_transfer import KvLayout


class CacheView:
    """`layout`'s cache over `buffer` (an mmap of the cache segment, or any buffer that large)."""

    def __init__(self, layout: KvLayout, buffer: Any) -> None:
        whole = memoryview(buffer).cast("B")
        size = len(whole)
        if size < layout.segment_bytes:
            raise ValueError(
                f"a cache of {layout.num_blocks} blocks takes {layout.segment_bytes} bytes, "
                f"but its buffer has {size}"
            )
        slots = layout.num_blocks * layout.block_size + 1
        slot_bytes = layout.slot_bytes
        flat = np.frombuffer(buffer, dtype=np.uint8, count=layout.segment_bytes)
        self.layout = layout
        self.slots = flat.reshape(layout.num_layers, 2, slots, slot_bytes)
        self._bytes = whole[: layout.segment_bytes]  # slicing it is cheaper than `slots`
        self._part_bytes = slots * slot_bytes  # one layer's K (or V)

    def check_block_ids(self, block_ids: Sequence[int], what: str) -> None:
        """ValueError naming the first id that is not a block of this cache."""
        for block in block_ids:
            if not 0 <= block < self.layout.num_blocks:
                raise ValueError(
                    f"{what} block id {block} is not a block of this cache "
                    f"(0 <= id < {self.layout.num_blocks})"
                )

    def run(self, start: int, length: int) -> np.ndarray:
        """Blocks [start, start + length) of every layer's K and V: [layers, 2, slots, bytes]."""
        size = self.layout.block_size
        return self.slots[:, :, start * size : (start + length) * size]

    def chunks(self, block_ids: Sequence[int]) -> list[memoryview]:
        """The transfer stream of these blocks, as writable-if-the-cache-is buffers in stream
        order: one per (layer, K/V, run of consecutive ids)."""
        self.check_block_ids(block_ids, "a")
        chunk = self.layout.chunk_bytes
        spans = [(start * chunk, length * chunk) for start, length in runs(block_ids)]
        whole = self._bytes
        return [
            whole[part + offset : part + offset + size]
            for part in range(0, 2 * self.layout.num_layers * self._part_bytes, self._part_bytes)
            for offset, size in spans
        ]

    def stream_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.layout.block_bytes


def runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids, in order: (first id, length)."""
    found: list[tuple[int, int]] = []
    for block in block_ids:
        if found and found[-1][0] + found[-1][1] == block:
            found[-1] = (found[-1][0], found[-1][1] + 1)
        else:
            found.append((block, 1))
    return found


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs where both sides' ids are consecutive: (first src, first dst, length)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source block ids but {len(dst_ids)} destination ids")
    found: list[tuple[int, int, int]] = []
    for src, dst in zip(src_ids, dst_ids, strict=True):
        if found:
            first_src, first_dst, length = found[-1]
            if first_src + length == src and first_dst + length == dst:
                found[-1] = (first_src, first_dst, length + 1)
                continue
        found.append((src, dst, 1))
    return found


def check_compatible(src: KvLayout, dst: KvLayout) -> None:
    """ValueError with KvLayout.mismatch's text when blocks of `src` cannot go into `dst`."""
    mismatch = dst.mismatch(src)
    if mismatch is not None:
        raise ValueError(mismatch)


def copy_blocks(
    src: CacheView, dst: CacheView, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> int:
    """Copy blocks src_ids[i] -> dst_ids[i]; the bytes copied."""
    check_compatible(src.layout, dst.layout)
    src.check_block_ids(src_ids, "source")
    dst.check_block_ids(dst_ids, "destination")
    for src_start, dst_start, length in paired_runs(src_ids, dst_ids):
        np.copyto(dst.run(dst_start, length), src.run(src_start, length))
    return dst.stream_bytes(len(dst_ids))


def gather(view: CacheView, block_ids: Sequence[int]) -> bytes:
    """The transfer stream of these blocks as one contiguous buffer."""
    return b"".join(view.chunks(block_ids))


def scatter(view: CacheView, block_ids: Sequence[int], stream: bytes | memoryview) -> None:
    """Write a transfer stream (from `gather` or a socket) into these blocks."""
    expected = view.stream_bytes(len(block_ids))
    if len(stream) != expected:
        raise ValueError(
            f"a stream of {len(block_ids)} blocks is {expected} bytes, not {len(stream)}"
        )
    source = memoryview(stream).cast("B")
    offset = 0
    for chunk in view.chunks(block_ids):
        chunk[:] = source[offset : offset + len(chunk)]
        offset += len(chunk)
