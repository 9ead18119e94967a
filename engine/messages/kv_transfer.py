"""KV transfer between a prefill instance and a decode instance (P/D disaggregation).

Roles. A prefill instance's scheduler, once a request's first token is sampled, keeps the
request's full prompt blocks (a *hold*) and hands the request on with a `KvSource`: where its
KV lies (every rank's kv_transfer endpoint), which blocks, and their layout. A decode instance's
scheduler, given a request with a `KvSource`, asks its kv_transfer actors to *pull* the blocks
its prefix cache lacks into blocks it set aside; once every rank reports them arrived, it indexes
them in its prefix cache and admits the request, which then computes only the tail (the prompt's
last, partial block and the delivered tokens).

Transfer ids are random strings of 128 bits (32 hex digits), one per attempt, never derived from
the request's id (a client chooses that one): only the two ends of a transfer know it.

Rings, per instance (one kv_transfer actor per worker rank; engine/messages/ring_catalogue.py):
- KV_ORDERS_RING: scheduler -> every rank's kv_transfer (broadcast): `HoldBlocks`, `DropHolds`,
  `PullBlocks`.
- KV_EVENTS_RING (one per rank): that rank's kv_transfer -> scheduler: `TransferEndpoint` (at
  every start), `BlocksReleased`, `BlocksPulled`, `ConnectionsRefused`.

A request's KV has arrived only when every rank has reported it (`BlocksPulled` without error
from each); a hold ends when every rank has reported the receiver's acknowledgement
(`BlocksReleased`), or at its deadline: the scheduler frees the blocks then, whatever the ranks
said, so nothing leaks when a peer vanishes.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from engine.messages.codec import Channel

# What a prefill instance does after a request's first token (SubmitRequest.kv_handoff).
KvHandoff = Literal["", "continue", "hold"]


class KvLayout(msgspec.Struct, frozen=True, omit_defaults=True):
    """The shape of one rank's KV cache: two ends of a transfer must agree on all of it (but
    `num_blocks`, each side's own). The cache is `[num_layers, 2, num_blocks * block_size + 1,
    num_kv_heads, head row]` (K and V; the extra slot is the zero padding slot; a head row is
    `head_dim` elements of `dtype`, then `scale_bytes`), so one layer's K (or V) of one block is
    `chunk_bytes` contiguous bytes."""

    model: str  # architecture and shape, e.g. "LlamaForCausalLM/L4/H8/D64/V8192"
    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    block_size: int
    dtype: str  # "bfloat16", "float32", ...
    itemsize: int
    tp_size: int
    tp_rank: int
    num_blocks: int
    # After each head row's elements (an int8 row's float32 scale). Left out of the encoding
    # when 0 (omit_defaults), so that every other layout is encoded as before it existed: the
    # frames and signatures of a float cache's transfers do not change.
    scale_bytes: int = 0

    @property
    def slot_bytes(self) -> int:
        """One token's K (or V) of one layer: every KV head's row."""
        return self.num_kv_heads * (self.head_dim * self.itemsize + self.scale_bytes)

    @property
    def chunk_bytes(self) -> int:
        """One block's K (or V) of one layer."""
        return self.block_size * self.slot_bytes

    @property
    def block_bytes(self) -> int:
        """One block across every layer, K and V."""
        return 2 * self.num_layers * self.chunk_bytes

    @property
    def segment_bytes(self) -> int:
        """The whole cache (the padding slot included)."""
        return 2 * self.num_layers * (self.num_blocks * self.block_size + 1) * self.slot_bytes

    def mismatch(self, other: KvLayout) -> str | None:
        """What differs between two ends of a transfer (rank for rank), or None."""
        for field in (
            "model",
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "block_size",
            "dtype",
            "tp_size",
            "tp_rank",
        ):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"KV layout mismatch: {field} is {mine!r} here but {theirs!r} at the peer"
        return None


class KvEndpoint(msgspec.Struct, frozen=True):
    """Where one rank's kv_transfer actor listens; `host_id` tells whether a puller shares its
    host (and may then read the cache segment directly instead of over TCP)."""

    host: str
    port: int
    host_id: str


class KvSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a handed-off request's prompt KV lies: `block_ids[i]` holds tokens
    [i * block_size, (i + 1) * block_size) of the prompt, on every rank. Across instances it is
    the kv_transfer_params object a client carries from the prefill instance to the decode one
    (so these three structs are maps, not arrays: a JSON object with named fields), signed by
    the prefill instance (engine/kv/transfer/signing.py): a client can carry it, not change it.

    `prompt_key` binds the blocks to the tokens they were computed for: the prefix-cache key
    (engine/kv/cache/prefix_cache.py, a hash chain) of the last held block. The decode side files
    the pulled blocks under its own request's keys only when its last one is this one."""

    transfer_id: str
    endpoints: list[KvEndpoint]  # one per rank, by rank
    block_ids: list[int]
    num_tokens: int  # the tokens the blocks hold (a multiple of block_size)
    layout: KvLayout  # rank 0's (another rank's differs only in tp_rank and num_blocks)
    prompt_key: str = ""  # hex; "" when no block is held
    expires_at: float = 0.0  # time.time() after which a decode instance refuses it (signed)
    signature: str = ""  # hex HMAC-SHA256 of everything above, with the deployment secret


# ---- scheduler -> kv_transfer (KV_ORDERS_RING) -------------------------------------------------


class HoldBlocks(msgspec.Struct, tag=True, array_like=True):
    """Serve these blocks to whoever pulls `transfer_id`, until acknowledged or `deadline`
    (time.monotonic() of this host)."""

    transfer_id: str
    block_ids: list[int]
    deadline: float


class DropHolds(msgspec.Struct, tag=True, array_like=True):
    """The scheduler freed these holds (expired, or the request is gone): serve them no more."""

    transfer_ids: list[str]


class PullBlocks(msgspec.Struct, tag=True, array_like=True):
    """Copy the source's `src_block_ids` into this rank's `dst_block_ids` (pairwise), then
    acknowledge to the source. Give up at `deadline` (time.monotonic() of this host)."""

    transfer_id: str
    source: KvSource
    src_block_ids: list[int]
    dst_block_ids: list[int]
    deadline: float


# ---- kv_transfer -> scheduler (KV_EVENTS_RING) -------------------------------------------------


class TransferEndpoint(msgspec.Struct, tag=True, array_like=True):
    """Sent once at every start: where this rank serves holds, and its cache layout."""

    rank: int
    endpoint: KvEndpoint
    layout: KvLayout


class BlocksReleased(msgspec.Struct, tag=True, array_like=True):
    """The puller acknowledged `transfer_id` on this rank (it has copied the blocks)."""

    transfer_id: str
    rank: int


class BlocksPulled(msgspec.Struct, tag=True, array_like=True):
    """This rank's part of a pull ended: arrived (error None) or not (error says why)."""

    transfer_id: str
    rank: int
    error: str | None
    num_bytes: int = 0
    seconds: float = 0.0
    via: str = ""  # "shm" or "tcp"


class ConnectionsRefused(msgspec.Struct, tag=True, array_like=True):
    """Connections this rank closed since its last report because the peer did not prove the
    deployment secret (counted in /metrics)."""

    rank: int
    count: int


KvOrder = HoldBlocks | DropHolds | PullBlocks
KvEvent = TransferEndpoint | BlocksReleased | BlocksPulled | ConnectionsRefused

KV_ORDERS: Channel[KvOrder] = Channel("kv-orders", KvOrder)
KV_EVENTS: Channel[KvEvent] = Channel("kv-events", KvEvent)
