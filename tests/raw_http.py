"""Reading an HTTP/1.1 response off a raw socket, for tests that must control the bytes a client
sends (trickled bodies, reused connections) where an HTTP client library would hide them."""

from __future__ import annotations

import socket


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a content-length body; what arrived, short, if the server closed
    first (b"" if it closed without a byte)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def read_head_and_body(sock: socket.socket) -> tuple[bytes, bytes]:
    """read_response's answer split into (head, body)."""
    head, _, body = read_response(sock).partition(b"\r\n\r\n")
    return head, body
