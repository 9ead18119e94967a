"""A puller's connections to its sources: opened with the handshake (and TLS where set up), and
kept after a clean pull for the next pull from the same source, so a decode instance that pulls
from one prefill instance again and again pays the connection and the handshake once.

A kept connection is reused only while it is fresh (REUSE_WITHIN_S, well inside a server's
idle timeout) and still quiet: an idle connection with anything to read has been closed (the
server restarted or timed it out) or is out of step, and is dropped instead.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time

from engine.kv.transfer.handshake import prove_to_server
from engine.kv.transfer.wire import remaining

REUSE_WITHIN_S = 10.0
KEPT_PER_SOURCE = 4  # idle connections kept per source (each holds a server thread)

Address = tuple[str, int]


class Connections:
    def __init__(self, secret: bytes, tls: ssl.SSLContext | None = None) -> None:
        self.secret = secret
        self.tls = tls
        self._idle: dict[Address, list[tuple[float, socket.socket]]] = {}
        self._lock = threading.Lock()  # pulls run on several threads

    def open(self, address: Address, deadline: float) -> socket.socket:
        """An authenticated connection to `address`: a kept one, or a new one."""
        kept = self._take(address)
        if kept is not None:
            return kept
        sock = socket.create_connection(address, timeout=remaining(deadline))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock)
            prove_to_server(sock, self.secret, deadline)
        except BaseException:
            sock.close()
            raise
        return sock

    def keep(self, address: Address, sock: socket.socket) -> None:
        """`sock` ended a pull in step: the next pull from `address` may use it."""
        with self._lock:
            idle = self._idle.setdefault(address, [])
            idle.append((time.monotonic(), sock))
            while len(idle) > KEPT_PER_SOURCE:
                idle.pop(0)[1].close()

    def close(self) -> None:
        with self._lock:
            for idle in self._idle.values():
                for _, sock in idle:
                    sock.close()
            self._idle.clear()

    def _take(self, address: Address) -> socket.socket | None:
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get(address, [])
            while idle:
                since, sock = idle.pop()
                if now - since < REUSE_WITHIN_S and _quiet(sock):
                    return sock
                sock.close()
        return None


def _quiet(sock: socket.socket) -> bool:
    """Nothing to read on an idle connection (TLS may have a session ticket pending: not data)."""
    if not select.select([sock], [], [], 0)[0]:
        return True
    sock.setblocking(False)  # every later wait sets its own timeout again
    try:
        with contextlib.suppress(ssl.SSLWantReadError, BlockingIOError):
            sock.recv(1)
            return False  # the peer closed, or sent what nobody asked for
        return True
    except OSError:
        return False
