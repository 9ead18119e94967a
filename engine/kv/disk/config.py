"""What the scheduler's process needs to run the prefix cache's disk tier (engine/kv/disk/)."""

from __future__ import annotations

import msgspec

from engine.messages.kv_transfer import KvLayout


class KvDiskConfig(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # the tier's directory (engine/kv/disk/store.py)
    max_bytes: int
    namespace: str  # hex: what the KV depends on besides its tokens (namespace.py)
    description: str  # ... in words, for the log
    layouts: list[KvLayout]  # each rank's cache, by rank
    cache_segments: list[str]  # each rank's cache segment (SegmentDecl names), by rank
