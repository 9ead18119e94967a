"""The serving side of a transfer: answers pulls of held blocks of this rank's cache.

Each connection is served by blocking calls on its own thread (the caller's choice), so bulk
sends never hold the actor's event loop; every wait is bounded (the handshake by its timeout, an
idle connection by `idle_timeout`, a send of blocks by the hold's deadline).

Nothing is read from a peer before it proves the deployment secret (handshake.py); one that
does not is refused, reported to `on_refused` with its address, and closed. An acknowledgement
counts only for a transfer pulled on the same connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

from engine.kv.transfer.cache_view import CacheView
from engine.kv.transfer.handshake import HANDSHAKE_TIMEOUT, admit_puller
from engine.kv.transfer.holds import HoldTable
from engine.kv.transfer.refusals import RefusalLog
from engine.kv.transfer.wire import (
    TO_PULLER,
    TO_SERVER,
    VIA_SHM,
    VIA_TCP,
    Acknowledge,
    AckResult,
    BlocksFollow,
    ConnectionEnded,
    ProtocolError,
    PullRequest,
    ShmGrant,
    WireError,
    send_buffers,
)

REPLY_TIMEOUT = 10.0  # for a small reply to a puller that stopped reading
# Connections one peer address may have served at once: a quarter of the actor's 64 slots, so
# no single peer (authenticated or not) can hold them all. A decode host keeps at most 4 idle
# connections per source and rank (connections.KEPT_PER_SOURCE), so honest pullers stay under.
MAX_PER_PEER = 16
HOLD_ARRIVAL_S = 1.0  # how long a pull of an unknown transfer waits for its hold order

log = logging.getLogger("engine.kv.transfer")


class Refused(Exception):
    """A pull this server will not serve; the text goes to the puller."""


class BlockServer:
    def __init__(
        self,
        view: CacheView,
        segment: str,
        holds: HoldTable,
        host_id: str,
        on_released: Callable[[str], None],
        *,
        secret: bytes,
        on_refused: Callable[[str], None] = lambda peer: None,
        tls: ssl.SSLContext | None = None,
        idle_timeout: float = 30.0,
        hold_arrival: float = HOLD_ARRIVAL_S,
        max_per_peer: int = MAX_PER_PEER,
    ) -> None:
        self.view = view
        self.segment = segment  # the shared-memory name of the cache `view` shows
        self.holds = holds
        self.host_id = host_id
        self.on_released = on_released  # called (on the connection's thread) per acknowledgement
        self.on_refused = on_refused  # called (on the connection's thread) with the peer address
        self.secret = secret
        self.tls = tls
        self.idle_timeout = idle_timeout
        self.hold_arrival = hold_arrival
        self.max_per_peer = max_per_peer
        self.crowded = 0  # connections closed at once: their peer had max_per_peer served
        self._per_peer: dict[str, int] = {}
        self._per_peer_lock = threading.Lock()  # serve() runs on a thread per connection
        self._crowded_log = RefusalLog()

    def serve(self, sock: socket.socket) -> None:
        """Answer requests on `sock` until the peer closes it, errs, or idles; closes it. A
        peer that already has `max_per_peer` connections served is closed at once, before
        its handshake."""
        with sock:
            peer = _address(sock)
            if not self._enter(peer):
                return
            try:
                self._serve_admitted(sock, peer)
            finally:
                self._leave(peer)

    def _enter(self, peer: str) -> bool:
        with self._per_peer_lock:
            served = self._per_peer.get(peer, 0)
            if served < self.max_per_peer:
                self._per_peer[peer] = served + 1
                return True
            self.crowded += 1
            count = self._crowded_log.note(peer, time.monotonic())
        if count is not None:
            log.warning(
                "closed %d kv_transfer connection(s) from %s: it already has %d served "
                "(logged once a minute per peer)",
                count,
                peer,
                self.max_per_peer,
            )
        return False

    def _leave(self, peer: str) -> None:
        with self._per_peer_lock:
            left = self._per_peer[peer] - 1
            if left:
                self._per_peer[peer] = left
            else:
                del self._per_peer[peer]

    def _serve_admitted(self, sock: socket.socket, peer: str) -> None:
        if self.tls is not None:
            try:
                sock.settimeout(HANDSHAKE_TIMEOUT)
                sock = self.tls.wrap_socket(sock, server_side=True)
            except (ssl.SSLError, OSError):
                self.on_refused(peer)
                return
        with sock:
            if not admit_puller(sock, self.secret):
                self.on_refused(peer)
                return
            self._serve_requests(sock)

    def _serve_requests(self, sock: socket.socket) -> None:
        pulled: set[str] = set()  # transfers this connection was given: the ones it may ack
        while True:
            try:
                request = TO_SERVER.receive(sock, time.monotonic() + self.idle_timeout)
            except ProtocolError as exc:  # the stream is out of step: say why and close
                self._reply(sock, WireError(str(exc)))
                return
            except (ConnectionEnded, OSError):
                return
            try:
                if isinstance(request, PullRequest):
                    self._serve_pull(sock, request)
                    pulled.add(request.transfer_id)
                else:
                    self._acknowledge(sock, request, pulled)
            except Refused as exc:
                self._reply(sock, WireError(str(exc)))
            except (ProtocolError, OSError):
                return

    def _serve_pull(self, sock: socket.socket, request: PullRequest) -> None:
        mismatch = self.view.layout.mismatch(request.layout)
        if mismatch is not None:
            raise Refused(mismatch)
        try:
            self.view.check_block_ids(request.block_ids, "requested")
            hold = self.holds.check(
                request.transfer_id, request.block_ids, arrival=self.hold_arrival
            )
        except ValueError as exc:
            raise Refused(str(exc)) from None
        if request.via == VIA_SHM:
            if request.host_id != self.host_id:
                raise Refused(
                    f"a shared-memory pull needs the same host: the puller's host id is "
                    f"{request.host_id!r}, this server's {self.host_id!r}"
                )
            self._reply(sock, ShmGrant(self.segment, self.view.layout))
        elif request.via == VIA_TCP:
            chunks = self.view.chunks(request.block_ids)
            num_bytes = self.view.stream_bytes(len(request.block_ids))
            TO_PULLER.send(sock, BlocksFollow(num_bytes), hold.deadline)
            send_buffers(sock, chunks, hold.deadline)
        else:
            raise Refused(f"via must be {VIA_SHM!r} or {VIA_TCP!r}, got {request.via!r}")

    def _acknowledge(self, sock: socket.socket, ack: Acknowledge, pulled: set[str]) -> None:
        try:
            if ack.transfer_id not in pulled:
                raise ValueError(f"transfer {ack.transfer_id!r} was not pulled on this connection")
            pulled.discard(ack.transfer_id)  # a kept connection's set stays small
            self.holds.acknowledge(ack.transfer_id)
        except ValueError as exc:
            self._reply(sock, AckResult(ack.transfer_id, str(exc)))
            return
        self.on_released(ack.transfer_id)
        self._reply(sock, AckResult(ack.transfer_id, None))

    def _reply(self, sock: socket.socket, message: WireError | ShmGrant | AckResult) -> None:
        with contextlib.suppress(OSError):  # the puller is gone: it learns nothing more
            TO_PULLER.send(sock, message, time.monotonic() + REPLY_TIMEOUT)


def _address(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:  # reset before we asked
        return "?"
