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
  the request's handler sees the client gone. Trickling does not extend it.
- A cap on open connections (`server.max_connections`). uvicorn's `limit_concurrency` answers
  503 only once a head has arrived, and counts every open connection, so past the limit the next
  request of an existing client is refused too. Here a connection over the cap is answered 503
  and closed as it opens, and those already open keep working.
- A fixed kernel send buffer per connection (`server.send_buffer`). Left to the kernel, a TCP
  socket's send buffer autotunes up to net.ipv4.tcp_wmem's maximum (4 MiB on many hosts, more on
  tuned ones), on loopback within a second, and so holds megabytes of a stream its client
  never reads. All that time the request goes on generating as if read, and an output smaller
  than the machine's buffers runs to its end unread: whether a stalled client is detected would
  depend on the host's sysctls. With the buffer fixed, a client that stops reading
  fills it, then uvicorn's transport (paused at its high-water mark), then the request's output
  stream, whose stall aborts the request (engine/gateway/output_stream.py) on any host.

The protocol is uvicorn's h11 one, subclassed (passed as `uvicorn.Config(http=...)`): it is the
one uvicorn picks without httptools, which the engine does not depend on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from http import HTTPStatus

from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.http.errors import ApiError

log = logging.getLogger("engine.http")

_WARN_INTERVAL_S = 10.0  # a flood of refused connections logs one line per interval
_last_refusal_warning = -_WARN_INTERVAL_S


def guarded_http_protocol(
    header_timeout: float,
    max_connections: int,
    send_buffer: int = 0,
    body_timeout: float = 60.0,
) -> type[asyncio.Protocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`; `send_buffer` 0 leaves the
    kernel's send buffer autotuned."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout": header_timeout,
            "max_connections": max_connections,
            "send_buffer": send_buffer,
            "body_timeout": body_timeout,
        },
    )


# How long an idle kept-alive connection stays open. Longer than clients keep idle connections
# in their pools (httpx and so the openai package: 5 s; aiohttp: 15 s), so that the client, not
# the server, ends an idle connection: a server closing one just as a client reuses it loses
# that request (the client reads an empty reply). nginx's default is 75 s too.
KEEP_ALIVE_S = 75


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    max_connections: int = 2048
    send_buffer: int = 0
    body_timeout: float = 60.0
    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _idle: bool = False  # between a response and the first byte of the next request

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # counts this connection in self.connections
        if len(self.connections) > self.max_connections:
            _warn_refusal(self.max_connections)
            message = (
                f"the server has {self.max_connections} connections open "
                "(server.max_connections); retry shortly"
            )
            _answer_and_close(transport, ApiError(503, message, headers={"Retry-After": "1"}))
            return
        _fix_send_buffer(transport, self.send_buffer)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        self._idle = False
        super().data_received(data)
        self._watch_head()
        self._watch_body()

    def on_response_complete(self) -> None:
        self._idle = True
        super().on_response_complete()
        self._watch_head()
        self._watch_body()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._stop_body_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """Run the head timer exactly while the connection owes us a request head."""
        awaiting_head = self.cycle is None or self.cycle.response_complete
        if not awaiting_head or self._idle or self.transport.is_closing():
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
        _answer_and_close(self.transport, ApiError(408, message))

    def _watch_body(self) -> None:
        """Run the body timer from the end of a request's head until its body has all come
        (or the request is answered, or the connection closes)."""
        cycle = self.cycle
        receiving = cycle is not None and cycle.more_body and not cycle.response_complete
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
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # an answer has begun: it cannot become a 408
            return
        message = (
            f"the request body did not arrive within {self.body_timeout:g} s of its head "
            "(server.body_timeout)"
        )
        _answer_and_close(self.transport, ApiError(408, message))


def _fix_send_buffer(transport: asyncio.Transport, size: int) -> None:
    """Set SO_SNDBUF, which also turns the kernel's autotuning off for this socket. The kernel
    doubles the value for its bookkeeping and caps it at net.core.wmem_max."""
    sock = transport.get_extra_info("socket")
    if size and sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        except OSError as e:  # a socket type without the option: keep the kernel's default
            log.debug("cannot set SO_SNDBUF on %r: %s", sock, e)


def _answer_and_close(transport: asyncio.Transport, error: ApiError) -> None:
    """Write a whole response outside h11 (no request was read, so it has no cycle to answer
    in) and close: the connection is not reused."""
    body = error.encoded()
    head = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in error.headers.items()),
    ]
    transport.write("\r\n".join(head).encode() + b"\r\n\r\n" + body)
    transport.close()


def _warn_refusal(max_connections: int) -> None:
    global _last_refusal_warning
    now = time.monotonic()
    if now - _last_refusal_warning >= _WARN_INTERVAL_S:
        _last_refusal_warning = now
        log.warning("refusing connections: %d open (server.max_connections)", max_connections)
