"""What a kv_transfer actor is started with (encoded into its ChildSpec by the plan)."""

from __future__ import annotations

import msgspec

from engine.messages.kv_transfer import KvLayout


class KvTransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    rank: int  # the worker rank whose cache it moves
    layout: KvLayout  # that rank's cache
    cache_segment: str  # logical name of the SegmentDecl holding the cache (Actor.segments)
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0: any free port (announced in TransferEndpoint)
    advertise_host: str | None = None  # what pullers connect to (default: listen_host)
    force_tcp: bool = False  # never read a peer's cache through shared memory
