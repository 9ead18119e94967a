"""No reset paths (issue 31 item 3): however a request fails, its client reads a whole answer,
and a connection the client may reuse is one the server keeps open. (The connection guards' side,
early answers and refusals, is tests/unit/test_connection_guards.py.)

The server's own failures are forced with the shared server's HTTP fault injection
(engine/testing/http_faults.py): a request whose body holds FAULT_500 makes the handler raise
(the generic handler's 500), one holding FAULT_IN_STREAM makes its stream raise after its first
event.
"""

from __future__ import annotations

import json
import socket

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import FAULT_500, FAULT_IN_STREAM
from tests.e2e.harness import API_KEY, Server
from tests.raw_http import read_head_and_body

CYCLES = 1000


def connect(server: Server) -> socket.socket:
    url = httpx.URL(server.url)
    assert url.port is not None
    return socket.create_connection((url.host, url.port), timeout=30)


def raw_request(server: Server, method: str, path: str, body: bytes = b"") -> bytes:
    head = [f"{method} {path} HTTP/1.1", f"Host: {httpx.URL(server.url).host}"]
    head.append(f"Authorization: Bearer {API_KEY}")
    if method == "POST":
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def test_a_500_says_connection_close_and_a_pool_reusing_connections_loses_nothing(
    server: Server,
) -> None:
    """uvicorn closes a connection once an exception has escaped the app, after the generic
    handler's 500 is sent; that 500 must say so, or the client pools the connection and may
    send its next request on it as it closes (read as a ReadError)."""
    body = json.dumps({"prompt": FAULT_500, "max_tokens": 1}).encode()
    errors_before = error_count(server)
    with connect(server) as sock:
        sock.sendall(raw_request(server, "POST", "/v1/completions", body))
        head, error_body = read_head_and_body(sock)
        assert sock.recv(1) == b""  # and the server closed it
    assert head.startswith(b"HTTP/1.1 500 "), head
    assert b"connection: close" in head.lower(), head
    error = json.loads(error_body)["error"]
    assert error["message"].startswith("internal server error") and error["type"] == "server_error"

    failures: list[str] = []
    with server.http(timeout=30.0) as http:
        for _ in range(CYCLES):
            try:
                resp = http.post("/v1/completions", json={"prompt": FAULT_500, "max_tokens": 1})
                if resp.status_code != 500:
                    failures.append(f"fault: {resp.status_code}")
                resp = http.get("/v1/models")
                if resp.status_code != 200:
                    failures.append(f"reuse: {resp.status_code}")
            except httpx.TransportError as e:
                failures.append(f"{type(e).__name__}: {e}")
    assert failures == [], f"{len(failures)} of {CYCLES} cycles failed, e.g. {failures[:3]}"
    # Each generic 500 is counted, as an error of its endpoint (the first one too).
    assert error_count(server) - errors_before == CYCLES + 1


def error_count(server: Server) -> float:
    with server.http() as http:
        text = http.get("/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "engine:http_requests_total"
        and sample.labels.get("endpoint") == "completions"
        and sample.labels.get("outcome") == "error"
    )


def test_a_stream_that_fails_ends_with_an_error_event_and_done(server: Server) -> None:
    """A failure inside a stream (not an engine refusal) used to escape it: uvicorn cut the
    connection mid-body and the client read a broken transfer, no error, no [DONE]."""
    request = {"prompt": FAULT_IN_STREAM, "max_tokens": 4, "stream": True}
    with server.http(timeout=30.0) as http:
        with http.stream("POST", "/v1/completions", json=request) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["message"].startswith("internal server error"), error
        assert error["type"] == "server_error"
        # The connection stayed usable: the next request is served (on it, or a new one).
        resp = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert resp.status_code == 200, resp.text
