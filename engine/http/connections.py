"""uvicorn's HTTP/1.1 protocol with the connection guards uvicorn lacks.

- A deadline for the request head (`server.header_timeout`). uvicorn (0.3x–0.5x) closes idle
  keep-alive connections, but sets no deadline on a head: a client that connects and sends half a
  head, or nothing, is held forever, and a few thousand such clients take every file descriptor
  (slowloris). A connection that has not completed its head in time is answered 408 and closed,
  as nginx, Apache and Node do. The deadline runs from the connection's start, or on a kept-alive
  connection from the first byte of its next head, not from the last byte, so trickling bytes does
  not extend it. An idle kept-alive connection is uvicorn's to close (KEEP_ALIVE_S), silently.
- A deadline for the request body (`server.body_timeout`), from the end of its head: a client
  that sends a head and then trickles its body (or none of it) would hold the request, and its
  connection, forever. Past the deadline the request is answered 408 and the connection closed;
  the request's handler sees the client gone. Trickling does not extend it. A request answered
  before its body came (a 401) keeps this deadline for the rest of its body; those bytes are not
  the start of a next head.
- A cap on open connections (`server.max_connections`). uvicorn's `limit_concurrency` answers
  503 only once a head has arrived, and counts every open connection, so past the limit the next
  request of an existing client is refused too. Here a connection over the cap is answered 503
  and closed as it opens, and those already open keep working. Below it, a cap per peer address
  (`server.max_connections_per_client`): one client holding idle connections could otherwise
  take the whole cap, and with it /health and /ready from every probe.
- No resets. A connection answered 408 or 503 here is closed without reading what its client is
  still sending, and closing a socket with unread bytes, or receiving bytes after the close, makes
  the kernel answer with a reset: the client's next send fails, and over a network the reset can
  destroy the answer before the client reads it. So the server half-closes after such an answer
  and drops what still comes until the client closes, or LINGER_S (the lingering close of RFC 9112
  section 9.6, as nginx and Apache do it).
- A fixed kernel send buffer per connection (`server.send_buffer`). Left to the kernel, a TCP
  socket's send buffer autotunes up to net.ipv4.tcp_wmem's maximum (4 MiB on many hosts, more on
  tuned ones), on loopback within a second, and so holds megabytes of a stream its client
  never reads. All that time the request goes on generating as if read, and an output smaller
  than the machine's buffers runs to its end unread: whether a stalled client is detected would
  depend on the host's sysctls. With the buffer fixed, a client that stops reading
  fills it, then uvicorn's transport (paused at its high-water mark), then the request's output
  stream, whose stall aborts the request (engine/inflight/output_stream.py) on any host.

The protocol is uvicorn's h11 one, subclassed (passed as `uvicorn.Config(http=...)`): it is the
one uvicorn picks without httptools, which the engine does not depend on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.http.openai.errors import ApiError

log = logging.getLogger("engine.http")

_WARN_INTERVAL_S = 10.0  # a flood of refused connections logs one line per interval
_last_refusal_warning = -_WARN_INTERVAL_S


def guarded_http_protocol(
    header_timeout: float,
    max_connections: int,
    send_buffer: int = 0,
    body_timeout: float = 60.0,
    max_per_client: int | None = None,
) -> type[asyncio.Protocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`; `send_buffer` 0 leaves the
    kernel's send buffer autotuned; `max_per_client` None: an eighth of `max_connections`."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout": header_timeout,
            "max_connections": max_connections,
            "max_per_client": max_per_client or max(1, max_connections // 8),
            "send_buffer": send_buffer,
            "body_timeout": body_timeout,
        },
    )


# How long an idle kept-alive connection stays open. Longer than clients keep idle connections
# in their pools (httpx and so the openai package: 5 s; aiohttp: 15 s), so that the client, not
# the server, ends an idle connection: a server closing one just as a client reuses it loses
# that request (the client reads an empty reply). nginx's default is 75 s too.
KEEP_ALIVE_S = 75
# How long a refused connection (408, 503) is kept half-closed, dropping what its client still
# sends, before it is closed: long enough for a request already on its way to arrive, short
# enough that a flood of refused connections holds few descriptors.
LINGER_S = 2.0


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    max_connections: int = 2048
    max_per_client: int = 256
    send_buffer: int = 0
    body_timeout: float = 60.0
    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # counts this connection in self.connections
        refusal, linger = self._over_a_cap()
        if refusal is not None:
            _warn_refusal(refusal)
            error = ApiError(503, f"{refusal}; retry shortly", headers={"Retry-After": "1"})
            self._refuse(error, linger)
            return
        _fix_send_buffer(transport, self.send_buffer)
        self._watch_head()

    def _over_a_cap(self) -> tuple[str | None, bool]:
        """Why this new connection is one too many (or None), and whether its refusal lingers.
        A client over its own cap is refused without lingering: its refused connections would
        otherwise pile up for LINGER_S each and fill the server's cap, which is what the
        per-client cap is there to prevent (it may miss its 503 to a reset: it is flooding)."""
        if len(self.connections) > self.max_connections:
            why = f"the server has {self.max_connections} connections open (server.max_connections)"
            return why, True
        peer = _peer(self)  # None: a Unix socket's peers
        mine = sum(_peer(other) == peer for other in self.connections)
        if peer is not None and mine > self.max_per_client:
            why = (
                f"this client has {self.max_per_client} connections open "
                "(server.max_connections_per_client)"
            )
            return why, False
        return None, False

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            return  # answered and refused: what the client still sends is dropped unread
        super().data_received(data)
        self._watch_head()
        self._watch_body()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()
        self._watch_body()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._stop_body_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._linger_timer is not None:
            self.transport.close()  # h11 has no request to end on a refused connection
            return
        super().shutdown()

    def _owes_head(self) -> bool:
        """Whether a request head is due now: on a new connection from its start; on a
        kept-alive one only once the next head's first byte has come. Not while the body of a
        request answered early (a 401 before its body was read) is still arriving: those bytes
        are the body's, under the body deadline, and the connection is idle after them."""
        if self.cycle is None:
            return True
        if not self.cycle.response_complete or self.conn.their_state is not h11.IDLE:
            return False
        return bool(self.conn.trailing_data[0])

    def _watch_head(self) -> None:
        """Run the head timer exactly while the connection owes us a request head."""
        if not self._owes_head() or self.transport.is_closing():
            self._stop_head_timer()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        message = (
            f"no complete request head within {self.header_timeout:g} s (server.header_timeout)"
        )
        self._refuse(ApiError(408, message))

    def _watch_body(self) -> None:
        """Run the body timer from the end of a request's head until its body has all come
        (whether or not the request was answered before it had), or the connection closes."""
        receiving = self.cycle is not None and self.conn.their_state is h11.SEND_BODY
        if not receiving or self.transport.is_closing():
            self._stop_body_timer()
        elif self._body_timer is None:
            self._body_timer = self.loop.call_later(self.body_timeout, self._body_timed_out)

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self._linger_timer is not None:
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # an answer has begun (or ended): it cannot become a 408
            return
        message = (
            f"the request body did not arrive within {self.body_timeout:g} s of its head "
            "(server.body_timeout)"
        )
        self._refuse(ApiError(408, message))

    def _refuse(self, error: ApiError, linger: bool = True) -> None:
        """Answer `error` outside h11 (there is no request, or none it can still answer) and
        end the connection without a reset. Closing a socket whose client is still sending makes
        the kernel answer with a reset, which can destroy the answer before the client reads
        it. So the server only ends its own side (FIN after the answer), drops what still comes
        and closes when the client does, or after LINGER_S at most (at once without `linger`)."""
        self._stop_head_timer()
        self._stop_body_timer()
        self._unset_keepalive_if_required()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the handler reading this request sees the client gone
            cycle.message_event.set()
        self._linger_timer = self.loop.call_later(LINGER_S if linger else 0, self.transport.close)
        self.transport.write(_error_response(error))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()


def _fix_send_buffer(transport: asyncio.Transport, size: int) -> None:
    """Set SO_SNDBUF, which also turns the kernel's autotuning off for this socket. The kernel
    doubles the value for its bookkeeping and caps it at net.core.wmem_max."""
    sock = transport.get_extra_info("socket")
    if size and sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        except OSError as e:  # a socket type without the option: keep the kernel's default
            log.debug("cannot set SO_SNDBUF on %r: %s", sock, e)


def _error_response(error: ApiError) -> bytes:
    """A whole response that ends the connection, written outside h11."""
    body = error.encoded()
    head = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in error.headers.items()),
    ]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


def _peer(connection: object) -> str | None:
    """A connection's peer address (uvicorn's `client`), None without one."""
    client = getattr(connection, "client", None)
    return client[0] if client else None


def _warn_refusal(why: str) -> None:
    global _last_refusal_warning
    now = time.monotonic()
    if now - _last_refusal_warning >= _WARN_INTERVAL_S:
        _last_refusal_warning = now
        log.warning("refusing connections: %s", why)
