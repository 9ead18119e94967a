"""The HTTP connection guards (engine/http/connections.py) end connections without resets and
without unsolicited answers (issue 31 item 3).

Each test runs uvicorn in a thread with the guarded protocol, short deadlines and a small ASGI app
on 127.0.0.1, and talks to it over real sockets: the protocol is what is under test, the engine
behind it plays no part. `/early` answers 401 without reading the request's body (as a failed
API key check does); every other path reads the body, then answers 200.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from engine.http.connections import KEEP_ALIVE_S, guarded_http_protocol
from tests.raw_http import read_response

HEADER_TIMEOUT_S = 0.3
BODY_TIMEOUT_S = 0.5
REFUSED_CLIENTS = 20
START_TIMEOUT_S = 10.0


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    status = 401
    if scope["path"] != "/early":
        status = 200
        while (await receive()).get("more_body", False):
            pass
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def guarded_server(
    header_timeout: float = HEADER_TIMEOUT_S,
    body_timeout: float = BODY_TIMEOUT_S,
    max_connections: int = 64,
    max_per_client: int | None = None,
) -> Iterator[int]:
    """A guarded uvicorn serving `app` on 127.0.0.1; its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    protocol = guarded_http_protocol(
        header_timeout, max_connections, 0, body_timeout, max_per_client
    )
    config = uvicorn.Config(
        app, http=protocol, lifespan="off", log_level="warning", timeout_keep_alive=KEEP_ALIVE_S
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
        listener.close()
    assert not thread.is_alive(), "uvicorn did not stop"


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection to the server from `source`, a loopback address (127.0.0.0/8 is all lo)."""
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def head(method: str, path: str, content_length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_connection_answered_before_its_body_is_not_answered_408_once_idle() -> None:
    """The body bytes that come after an early answer are not the start of a next head: the
    kept-alive connection then idles past the head deadline and still serves (it was answered
    an unsolicited 408 and closed)."""
    with guarded_server() as port, connect(port) as sock:
        sock.sendall(head("POST", "/early", 10))
        assert read_response(sock).startswith(b"HTTP/1.1 401 ")
        sock.sendall(b"x" * 10)  # the body it had promised, after the answer
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        sock.sendall(head("GET", "/ok"))
        answer = read_response(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer


def test_a_body_trickled_after_an_early_answer_is_cut_at_the_body_deadline() -> None:
    """The rest of a body answered early still has the body deadline (from the end of its
    head): a trickle cannot hold the connection."""
    with guarded_server(header_timeout=5.0) as port, connect(port) as sock:
        sock.sendall(head("POST", "/early", 10_000))
        started = time.monotonic()
        assert read_response(sock).startswith(b"HTTP/1.1 401 ")
        closed = False
        while not closed and time.monotonic() - started < 4.0:
            try:
                sock.sendall(b"x")
                if select.select([sock], [], [], 0.05)[0]:
                    closed = sock.recv(1) == b""
            except ConnectionError:
                closed = True
        elapsed = time.monotonic() - started
    # uvloop may fire a timer up to a millisecond early
    assert closed and BODY_TIMEOUT_S - 0.01 <= elapsed < BODY_TIMEOUT_S + 1.5, elapsed


def test_a_client_still_sending_when_refused_over_the_cap_reads_the_whole_503() -> None:
    """A connection over server.max_connections is answered 503 as it opens. Closed at once,
    the request bytes its client sends next met a closed socket: the kernel answered with a
    reset, the client's next send failed (and over a real network a reset can destroy the 503
    before it is read). Each refused client here sends its head, waits for the 503, then sends
    its body in two parts, then reads."""
    failures: list[str] = []
    with guarded_server(max_connections=1) as port, connect(port) as held:
        held.sendall(head("GET", "/ok"))
        assert read_response(held).startswith(b"HTTP/1.1 200 ")
        for _ in range(REFUSED_CLIENTS):
            with connect(port) as sock:
                try:
                    sock.sendall(head("POST", "/ok", 20))
                    select.select([sock], [], [], 2.0)
                    sock.sendall(b"x" * 10)
                    time.sleep(0.02)
                    sock.sendall(b"y" * 10)
                    answer = read_response(sock)
                    ended = sock.recv(1) == b""
                except OSError as e:
                    failures.append(f"{type(e).__name__}: {e}")
                    continue
            if not (answer.startswith(b"HTTP/1.1 503 ") and answer.endswith(b"}") and ended):
                failures.append(repr(answer))
        held.sendall(head("GET", "/ok"))  # and the open connection still serves
        assert read_response(held).startswith(b"HTTP/1.1 200 ")
    assert failures == [], f"{len(failures)} of {REFUSED_CLIENTS} refused clients: {failures[:3]}"


def test_one_client_cannot_take_every_connection_from_the_others() -> None:
    """A client holding idle connections took the whole cap (server.max_connections), and with it
    /health and /ready from every probe; its own connections now stop at the per-client cap."""
    with (
        guarded_server(header_timeout=30.0, max_connections=8, max_per_client=2) as port,
        contextlib.ExitStack() as held,
    ):
        answers = []
        for _ in range(8):  # the flood: as many idle connections as the server takes in all
            sock = held.enter_context(connect(port))
            answers.append(b"503" if select.select([sock], [], [], 0.5)[0] else b"open")
        assert answers.count(b"open") == 2
        refused = connect(port)
        refused.sendall(head("GET", "/ok"))
        assert b"server.max_connections_per_client" in read_response(refused)
        refused.close()
        with connect(port, source="127.0.0.2") as probe:  # another client: served
            probe.sendall(head("GET", "/ok"))
            assert read_response(probe).startswith(b"HTTP/1.1 200 ")
