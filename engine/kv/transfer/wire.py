"""The protocol between two kv_transfer actors over TCP: length-prefixed msgspec frames, each
side decoding only the frames it may receive (typed decoders: never pickle), then raw bytes.

A pull, on one connection (several may follow each other on it):

    puller                                  server (holds the blocks)
    PullRequest(id, blocks, layout, via) ->
                                         <- ShmGrant(segment, layout)      via "shm", same host
                                         <- BlocksFollow(n) + n raw bytes  via "tcp"
                                         <- WireError(why)                 anything wrong
    (copies the blocks into its cache)
    Acknowledge(id)                      ->
                                         <- AckResult(id, error)  error None: the hold was still
                                            valid (held, before its deadline) when acknowledged;
                                            only then has the pull arrived

A frame is a 4-byte big-endian length and that many bytes of msgpack. A frame longer than
MAX_FRAME_BYTES, cut short, malformed, or of a type the receiving side does not expect is a
ProtocolError naming what was wrong; the server answers it with a WireError and closes that
connection (the stream is out of step), and goes on serving the others.

Every connection starts with the handshake of handshake.py (inside TLS, where tls.py is set up):
the server reads no request from a peer that has not proved the deployment secret.

The messages are in engine/messages/kv_wire.py, with every other message type: plain types
that know nothing of actors or sockets (tests/unit/test_layering.py).
"""

from __future__ import annotations

import bisect
import itertools
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from engine.messages.kv_wire import (
    VIA_SHM,
    VIA_TCP,
    Acknowledge,
    AckResult,
    BlocksFollow,
    PullRequest,
    ShmGrant,
    ToPuller,
    ToServer,
    WireError,
)

__all__ = [  # the messages are re-exported: the protocol's users import them from here
    "VIA_SHM",
    "VIA_TCP",
    "AckResult",
    "Acknowledge",
    "BlocksFollow",
    "PullRequest",
    "ShmGrant",
    "ToPuller",
    "ToServer",
    "WireError",
]

MAX_FRAME_BYTES = 1 << 20  # a header; block bytes travel unframed after BlocksFollow
_LENGTH = struct.Struct(">I")
_IOV_MAX = 1024  # buffers per sendmsg / recvmsg_into call at most (Linux's IOV_MAX)
# ... and about this many bytes: a call moves at most what the socket buffers hold (a few MiB),
# and parsing a thousand small buffers to fill a few of them costs more than the bytes do.
_BATCH_BYTES = 4 << 20

T = TypeVar("T")


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow."""


class ConnectionEnded(Exception):
    """The peer closed the connection between frames."""


class Framer:
    """Typed frame reader/writer for one side of the protocol."""

    def __init__(self, receives: Any, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(receives)
        self._encoder = msgspec.msgpack.Encoder()
        self._expected = " | ".join(t.__name__ for t in getattr(receives, "__args__", (receives,)))
        self.max_frame_bytes = max_frame_bytes

    def send(self, sock: socket.socket, message: Any, deadline: float) -> None:
        payload = self._encoder.encode(message)
        if len(payload) > self.max_frame_bytes:
            raise ProtocolError(
                f"a {type(message).__name__} frame of {len(payload)} bytes exceeds the maximum "
                f"frame size ({self.max_frame_bytes})"
            )
        send_buffers(sock, [_LENGTH.pack(len(payload)), payload], deadline)

    def receive(self, sock: socket.socket, deadline: float) -> Any:
        header = bytearray(_LENGTH.size)
        got = recv_some(sock, memoryview(header), deadline)
        if got == 0:
            raise ConnectionEnded("the peer closed the connection")
        if got < len(header):
            recv_exactly(sock, memoryview(header)[got:], deadline, "a frame's length")
        (length,) = _LENGTH.unpack(header)
        if length > self.max_frame_bytes:
            raise ProtocolError(
                f"frame of {length} bytes exceeds the maximum frame size ({self.max_frame_bytes})"
            )
        payload = bytearray(length)
        recv_exactly(sock, memoryview(payload), deadline, f"a frame of {length} bytes")
        try:
            return self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"bad frame (expected {self._expected}): {exc}") from None


TO_SERVER = Framer(ToServer)
TO_PULLER = Framer(ToPuller)


def remaining(deadline: float) -> float:
    """Seconds left before `deadline` (time.monotonic()); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the transfer's deadline passed")
    return left


def recv_some(sock: socket.socket, buffer: memoryview, deadline: float) -> int:
    sock.settimeout(remaining(deadline))
    return sock.recv_into(buffer)


def recv_exactly(sock: socket.socket, buffer: memoryview, deadline: float, what: str) -> None:
    recv_into_buffers(sock, [buffer], deadline, what)


def recv_into_buffers(
    sock: socket.socket, buffers: Sequence[memoryview], deadline: float, what: str
) -> int:
    """Fill every buffer in order from the socket (scatter reads straight into their memory);
    ProtocolError if the peer closes first."""
    total = sum(len(buf) for buf in buffers)

    def receive(batch: list[memoryview]) -> int:
        if isinstance(sock, ssl.SSLSocket):  # TLS has no scatter read: one buffer a call
            return sock.recv_into(batch[0])
        return sock.recvmsg_into(batch)[0]

    got = _move(sock, buffers, deadline, receive)
    if got < total:
        raise ProtocolError(f"connection closed after {got} of the {total} bytes of {what}")
    return got


def send_buffers(
    sock: socket.socket, buffers: Sequence[memoryview | bytes], deadline: float
) -> int:
    """Send every buffer in order (gathered writes straight from their memory)."""

    def send(batch: list[memoryview]) -> int:
        if isinstance(sock, ssl.SSLSocket):  # TLS has no gathered write: one buffer a call
            return sock.send(batch[0])
        return sock.sendmsg(batch)

    return _move(sock, [memoryview(buf).cast("B") for buf in buffers], deadline, send)


def _move(
    sock: socket.socket,
    buffers: Sequence[memoryview],
    deadline: float,
    step: Callable[[list[memoryview]], int],
) -> int:
    """Run `step` (one sendmsg or recvmsg_into) over the buffers, about _BATCH_BYTES and at
    most _IOV_MAX buffers a call, until all are moved or a step moves nothing (the peer
    closed); the bytes moved. Positions are found by bisection, so the Python work per call
    does not grow with the number of buffers (a scattered transfer has 100,000s)."""
    pending = [buf for buf in buffers if len(buf)]
    ends = list(itertools.accumulate(len(buf) for buf in pending))  # stream offset past each
    total = ends[-1] if ends else 0
    done = index = 0  # bytes moved; the first buffer not wholly moved
    while done < total:
        sock.settimeout(remaining(deadline))
        end = min(bisect.bisect_left(ends, done + _BATCH_BYTES) + 1, index + _IOV_MAX)
        batch = pending[index:end]
        moved_of_first = len(pending[index]) - (ends[index] - done)
        if moved_of_first:
            batch[0] = batch[0][moved_of_first:]
        moved = step(batch)
        if moved == 0:
            break
        done += moved
        index = bisect.bisect_right(ends, done)
    return done
