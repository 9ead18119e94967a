"""What the scheduler asks of the disk tier's mover, and what the mover answers.

The scheduler (engine/scheduler/disk_tier.py) decides which blocks go to disk and which come
back, and into which block ids; the mover (engine/kv/disk/mover.py) does the I/O on a thread of
the scheduler's process and answers each order with one event, which carries the figures of what
it did. A block named in an order is the mover's until its event is back: the scheduler holds a
spilled block (nothing writes it meanwhile) and keeps a loading block out of the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpillBlocks:
    """Write each (block id, prefix key)'s KV to disk, unless it is there already."""

    blocks: list[tuple[int, bytes]]


@dataclass(frozen=True)
class LoadBlocks:
    """Read each (block id, prefix key) from disk into the block, in order, stopping at the first
    that cannot be (a later block is of no use without the ones before it)."""

    load_id: int
    blocks: list[tuple[int, bytes]]


@dataclass(frozen=True)
class BlocksSpilled:
    block_ids: list[int]
    written_blocks: int = 0
    written_bytes: int = 0
    evicted_blocks: int = 0  # files the size bound removed to make room
    full: bool = False  # the disk is full: nothing is written for a while
    error: str | None = None


@dataclass(frozen=True)
class BlocksLoaded:
    load_id: int
    num_loaded: int  # the order's first num_loaded blocks hold their KV now
    read_bytes: int = 0
    dropped_blocks: int = 0  # files that failed their checks (removed, never served)
    error: str | None = None  # why the load stopped short, if it did


DiskOrder = SpillBlocks | LoadBlocks
DiskEvent = BlocksSpilled | BlocksLoaded
