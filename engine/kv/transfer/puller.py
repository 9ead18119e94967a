"""The pulling side of a transfer: copy a source's held blocks into this rank's cache, then
acknowledge; the outcome is a BlocksPulled, whatever happened (errors never escape).

The source must prove the deployment secret (handshake.py) before the puller names a transfer
or reads a byte of it (connections.py keeps such a connection for the next pull), and a
same-host source's segment is mapped only if segment.py finds it one of ours, of the size its
layout says."""

from __future__ import annotations

import socket
import ssl
import threading
import time

from engine.kv.transfer.cache_view import CacheView, copy_blocks
from engine.kv.transfer.connections import Connections
from engine.kv.transfer.handshake import HandshakeFailed
from engine.kv.transfer.segment import Segments
from engine.kv.transfer.wire import (
    TO_PULLER,
    TO_SERVER,
    VIA_SHM,
    VIA_TCP,
    Acknowledge,
    AckResult,
    BlocksFollow,
    ProtocolError,
    PullRequest,
    ShmGrant,
    WireError,
    recv_into_buffers,
)
from engine.messages.kv_transfer import BlocksPulled, KvEndpoint, PullBlocks


class PullFailed(Exception):
    """The server refused the pull, or did not confirm its hold when acknowledged."""


class Puller:
    def __init__(
        self,
        view: CacheView,
        host_id: str,
        *,
        secret: bytes,
        segments: Segments,
        tls: ssl.SSLContext | None = None,
        force_tcp: bool = False,
    ) -> None:
        self.view = view
        self.segments = segments
        self.host_id = host_id
        self.force_tcp = force_tcp
        self.connections = Connections(secret, tls)
        self._sources: dict[str, CacheView] = {}  # segment name -> its view, mapped once
        self._lock = threading.Lock()  # pulls run on several threads

    def via(self, endpoint: KvEndpoint) -> str:
        return VIA_SHM if endpoint.host_id == self.host_id and not self.force_tcp else VIA_TCP

    def pull(self, order: PullBlocks, rank: int) -> BlocksPulled:
        """Blocking (run it on a thread); every wait ends by `order.deadline`."""
        started = time.monotonic()
        via = ""
        try:
            endpoint = _endpoint(order, rank)
            via = self.via(endpoint)
            num_bytes = self._pull(order, endpoint, via)
        except Exception as exc:  # any failure is this pull's outcome, never the actor's end
            error = f"pull of {order.transfer_id!r} failed: {_describe(exc)}"
            return BlocksPulled(order.transfer_id, rank, error, 0, time.monotonic() - started, via)
        return BlocksPulled(
            order.transfer_id, rank, None, num_bytes, time.monotonic() - started, via
        )

    def _pull(self, order: PullBlocks, endpoint: KvEndpoint, via: str) -> int:
        src_ids, dst_ids, deadline = order.src_block_ids, order.dst_block_ids, order.deadline
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source block ids but {len(dst_ids)} destination ids")
        self.view.check_block_ids(dst_ids, "destination")
        address = (endpoint.host, endpoint.port)
        sock = self.connections.open(address, deadline)
        try:
            num_bytes, result = self._exchange(sock, order, via)
        except BaseException:
            sock.close()  # out of step, or gone: never reused
            raise
        self.connections.keep(address, sock)
        if not isinstance(result, AckResult):
            raise ProtocolError(f"a {type(result).__name__} in answer to an acknowledgement")
        if result.error is not None:
            raise PullFailed(f"the source did not confirm its hold: {result.error}")
        return num_bytes

    def _exchange(self, sock: socket.socket, order: PullBlocks, via: str) -> tuple[int, object]:
        """The pull on an authenticated connection: (bytes copied, the AckResult frame)."""
        src_ids, dst_ids, deadline = order.src_block_ids, order.dst_block_ids, order.deadline
        request = PullRequest(order.transfer_id, src_ids, self.view.layout, self.host_id, via)
        TO_SERVER.send(sock, request, deadline)
        reply = TO_PULLER.receive(sock, deadline)
        if isinstance(reply, WireError):
            raise PullFailed(f"the source refused it: {reply.error}")
        if isinstance(reply, ShmGrant) and via == VIA_SHM:
            num_bytes = copy_blocks(self._source(reply), self.view, src_ids, dst_ids)
        elif isinstance(reply, BlocksFollow) and via == VIA_TCP:
            num_bytes = self.view.stream_bytes(len(dst_ids))
            if reply.num_bytes != num_bytes:
                raise ProtocolError(f"{reply.num_bytes} bytes announced, {num_bytes} expected")
            chunks = self.view.chunks(dst_ids)
            recv_into_buffers(sock, chunks, deadline, f"transfer {order.transfer_id!r}")
        else:
            raise ProtocolError(f"a {type(reply).__name__} in answer to a {via} pull")
        TO_SERVER.send(sock, Acknowledge(order.transfer_id), deadline)
        return num_bytes, TO_PULLER.receive(sock, deadline)

    def _source(self, grant: ShmGrant) -> CacheView:
        with self._lock:
            view = self._sources.get(grant.segment)
            if view is None or view.layout != grant.layout:
                # A source run that ended unlinked its segment, but our mapping would keep its
                # memory (a whole cache) alive: let go of those before mapping another.
                for name in [n for n in self._sources if not self.segments.exists(n)]:
                    del self._sources[name]
                view = CacheView(
                    grant.layout, self.segments.map_source(grant.segment, grant.layout)
                )
                self._sources[grant.segment] = view
            return view


def _endpoint(order: PullBlocks, rank: int) -> KvEndpoint:
    endpoints = order.source.endpoints
    if not 0 <= rank < len(endpoints):
        raise ValueError(f"the source names {len(endpoints)} endpoint(s), none for rank {rank}")
    return endpoints[rank]


def _describe(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return f"timed out ({exc or 'no answer before the deadline'})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc}"
    if isinstance(exc, ConnectionError | ProtocolError | PullFailed | ValueError | HandshakeFailed):
        return str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {exc}"
