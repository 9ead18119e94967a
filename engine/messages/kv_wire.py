"""Messages between two kv_transfer actors over TCP (engine/kv/transfer/wire.py frames them and
says how a pull goes; engine/kv/transfer/handshake.py how a connection is authenticated first).
They never travel over a ring."""

from __future__ import annotations

import msgspec

from engine.messages.kv_transfer import KvLayout

VIA_SHM = "shm"
VIA_TCP = "tcp"


# ---- the handshake, before any request (engine/kv/transfer/handshake.py) ----------------------


class Challenge(msgspec.Struct, tag=True, array_like=True):
    """The server's first frame on every connection."""

    nonce: bytes


class Proof(msgspec.Struct, tag=True, array_like=True):
    """The puller's answer: its own nonce and its MAC over both."""

    nonce: bytes
    mac: bytes


class Accepted(msgspec.Struct, tag=True, array_like=True):
    """The server's MAC over both nonces (the puller checks it before sending a request)."""

    mac: bytes


# ---- requests and replies ------------------------------------------------------------------


class PullRequest(msgspec.Struct, tag=True, array_like=True):
    transfer_id: str
    block_ids: list[int]  # the server's blocks, in stream order
    layout: KvLayout  # the puller's
    host_id: str  # the puller's (see host.host_id)
    via: str  # VIA_SHM or VIA_TCP


class Acknowledge(msgspec.Struct, tag=True, array_like=True):
    transfer_id: str


class ShmGrant(msgspec.Struct, tag=True, array_like=True):
    segment: str  # the server's cache segment: map it read-only and copy
    layout: KvLayout  # the server's (its num_blocks sizes the segment)


class BlocksFollow(msgspec.Struct, tag=True, array_like=True):
    num_bytes: int


class AckResult(msgspec.Struct, tag=True, array_like=True):
    transfer_id: str
    error: str | None


class WireError(msgspec.Struct, tag=True, array_like=True):
    error: str


ToServer = PullRequest | Acknowledge
ToPuller = ShmGrant | BlocksFollow | AckResult | WireError
HandshakeToPuller = Challenge | Accepted | WireError
