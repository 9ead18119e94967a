"""Both ends of a KV pull over real loopback sockets and a real shared-memory segment (threads,
no processes): what arrives, what is acknowledged, and every refusal with the reason it names."""

from __future__ import annotations

import contextlib
import gc
import itertools
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from engine.kv.transfer.cache_view import CacheView
from engine.kv.transfer.handshake import prove_to_server
from engine.kv.transfer.holds import HoldTable
from engine.kv.transfer.puller import Puller
from engine.kv.transfer.segment import Segments
from engine.kv.transfer.server import MAX_PER_PEER, BlockServer
from engine.kv.transfer.wire import (
    MAX_FRAME_BYTES,
    TO_PULLER,
    TO_SERVER,
    Acknowledge,
    AckResult,
    PullRequest,
    ShmGrant,
    WireError,
    recv_into_buffers,
    send_buffers,
)
from engine.messages.kv_transfer import KvEndpoint, KvLayout, KvSource, PullBlocks
from engine.runtime.shm import (
    SEGMENT_PREFIX,
    SHM_DIR,
    create_segment,
    run_prefix,
    unlink_segment,
)
from tests.unit.test_kv_cache_view import layout

HOST = "this-host"
SRC_BLOCKS, DST_BLOCKS = 8, 6
SECRET = secrets.token_bytes(32)


class Served:
    """A BlockServer over a shared-memory cache of random bytes, accepting on a thread."""

    def __init__(self) -> None:
        self.layout = layout(SRC_BLOCKS)
        self.segment = f"{run_prefix()}kvwire"
        self.view = CacheView(self.layout, create_segment(self.segment, self.layout.segment_bytes))
        rng = np.random.default_rng(0)
        self.view.slots[...] = rng.integers(0, 256, self.view.slots.shape, dtype=np.uint8)
        self.holds = HoldTable()
        self.released: list[str] = []
        self.refused: list[str] = []
        self.server = BlockServer(
            self.view,
            self.segment,
            self.holds,
            HOST,
            self.released.append,
            secret=SECRET,
            on_refused=self.refused.append,
            idle_timeout=5,
            hold_arrival=0.1,
        )
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.endpoint = KvEndpoint("127.0.0.1", self.listener.getsockname()[1], HOST)
        self._connections: list[socket.socket] = []
        self._stopped = threading.Event()
        self._accepting = threading.Thread(target=self._accept)
        self._accepting.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            self._connections.append(connection)
            threading.Thread(target=self.server.serve, args=(connection,), daemon=True).start()

    def close(self) -> None:
        self._stopped.set()
        self._accepting.join(10)
        self.listener.close()
        for connection in self._connections:  # as when the source's process ends
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        unlink_segment(self.segment)

    def order(self, transfer_id: str, src: list[int], dst: list[int]) -> PullBlocks:
        source = KvSource(transfer_id, [self.endpoint], src, len(src) * 4, self.layout)
        return PullBlocks(transfer_id, source, src, dst, time.monotonic() + 20)

    def connect(self) -> socket.socket:
        """A connection on which this test proved the deployment secret."""
        sock = socket.create_connection(self.listener.getsockname(), timeout=10)
        prove_to_server(sock, SECRET, time.monotonic() + 10)
        return sock

    def raw_exchange(self, payload: bytes) -> object:
        """Send raw bytes on a fresh authenticated connection (then close our writing side);
        the reply."""
        with self.connect() as sock:
            sock.sendall(payload)
            # A frame refused at its header is answered and the connection closed at once: it
            # may be gone (not connected) by the time our side closes its half.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            return TO_PULLER.receive(sock, time.monotonic() + 10)


@pytest.fixture
def served() -> Iterator[Served]:
    served = Served()
    yield served
    served.close()


def puller(force_tcp: bool = False, dst_layout: KvLayout | None = None) -> Puller:
    dst_layout = dst_layout or layout(DST_BLOCKS)
    view = CacheView(dst_layout, bytearray(dst_layout.segment_bytes))
    segments = Segments(SHM_DIR, SEGMENT_PREFIX)
    return Puller(view, HOST, secret=SECRET, segments=segments, force_tcp=force_tcp)


def block_bytes(buffer: object, lay: KvLayout, layer: int, kv: int, block_id: int) -> bytes:
    """One block's K or V of one layer, located by the layout's documented offsets."""
    slot_bytes = lay.num_kv_heads * lay.head_dim * lay.itemsize
    slots = lay.num_blocks * lay.block_size + 1
    start = ((layer * 2 + kv) * slots + block_id * lay.block_size) * slot_bytes
    return bytes(memoryview(buffer).cast("B")[start : start + lay.block_size * slot_bytes])  # type: ignore[arg-type]


@pytest.mark.parametrize("force_tcp", [False, True], ids=["shm", "tcp"])
def test_a_pull_copies_the_held_blocks_then_the_acknowledgement_ends_the_hold(
    served: Served, force_tcp: bool
) -> None:
    pulling = puller(force_tcp)
    src, dst = [1, 2, 3, 6], [0, 4, 5, 2]
    served.holds.hold("r1@0", src, time.monotonic() + 30)

    outcome = pulling.pull(served.order("r1@0", src, dst), rank=0)

    assert outcome.error is None and outcome.via == ("tcp" if force_tcp else "shm")
    assert outcome.num_bytes == len(src) * served.layout.block_bytes
    dst_buffer, dst_layout = pulling.view.slots, pulling.view.layout
    for s, d in zip(src, dst, strict=True):
        for layer in range(dst_layout.num_layers):
            for kv in (0, 1):
                expected = block_bytes(served.view.slots, served.layout, layer, kv, s)
                assert block_bytes(dst_buffer, dst_layout, layer, kv, d) == expected
    assert served.released == ["r1@0"] and len(served.holds) == 0
    again = pulling.pull(served.order("r1@0", src, dst), rank=0)
    assert again.error is not None and "acknowledged already" in again.error


@pytest.mark.parametrize(
    ("hold", "src", "expected"),
    [
        (None, [1], "'t@1' is not held: it is unknown here"),
        (-1.0, [1], "'t@1' is not held: its hold expired"),
        (30.0, [1, 5], "does not hold block(s) [5]"),
        (30.0, [1, 99], "requested block id 99 is not a block of this cache"),
    ],
    ids=["unknown", "expired", "not-held", "out-of-range"],
)
def test_a_pull_the_server_cannot_serve_says_why(
    served: Served, hold: float | None, src: list[int], expected: str
) -> None:
    if hold is not None:
        served.holds.hold("t@1", [1, 2], time.monotonic() + hold)

    outcome = puller(force_tcp=True).pull(served.order("t@1", src, list(range(len(src)))), 0)

    assert outcome.error is not None and expected in outcome.error
    assert served.released == []


def test_a_pull_of_another_layout_names_the_mismatch(served: Served) -> None:
    served.holds.hold("t@1", [1], time.monotonic() + 30)

    outcome = puller(dst_layout=layout(DST_BLOCKS, block_size=8)).pull(
        served.order("t@1", [1], [0]), 0
    )

    assert outcome.error is not None
    assert "KV layout mismatch: block_size is 4 here but 8 at the peer" in outcome.error
    assert len(served.holds) == 1  # still held for a puller that fits


def test_bad_frames_get_an_error_reply_and_the_server_serves_on(served: Served) -> None:
    oversized = struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x" * 16
    truncated = struct.pack(">I", 100) + b"x" * 10
    wrong_type = TO_PULLER._encoder.encode(ShmGrant("s", served.layout))
    wrong_type = struct.pack(">I", len(wrong_type)) + wrong_type
    garbage = struct.pack(">I", 3) + b"\xc1\xc1\xc1"
    request = PullRequest("t@1", [1], served.layout, "another-host", "shm")
    other_host = TO_SERVER._encoder.encode(request)
    other_host = struct.pack(">I", len(other_host)) + other_host
    expectations = [
        (oversized, f"exceeds the maximum frame size ({MAX_FRAME_BYTES})"),
        (truncated, "connection closed after 10 of the 100 bytes"),
        (wrong_type, "bad frame (expected PullRequest | Acknowledge)"),
        (garbage, "bad frame"),
        (other_host, "a shared-memory pull needs the same host"),
    ]
    served.holds.hold("t@1", [1], time.monotonic() + 30)
    for payload, expected in expectations:
        reply = served.raw_exchange(payload)
        assert isinstance(reply, WireError) and expected in reply.error

    assert puller().pull(served.order("t@1", [1], [3]), 0).error is None


def test_an_acknowledgement_after_the_hold_ended_is_not_an_arrival(served: Served) -> None:
    served.holds.hold("t@1", [1], time.monotonic() + 30)
    with served.connect() as sock:
        deadline = time.monotonic() + 10
        TO_SERVER.send(sock, PullRequest("t@1", [1], layout(DST_BLOCKS), HOST, "shm"), deadline)
        assert isinstance(TO_PULLER.receive(sock, deadline), ShmGrant)
        served.holds.drop(["t@1"], "the scheduler dropped its hold")
        TO_SERVER.send(sock, Acknowledge("t@1"), deadline)
        result = TO_PULLER.receive(sock, deadline)

    assert isinstance(result, AckResult)
    assert result.error == "transfer 't@1' is not held: the scheduler dropped its hold"
    assert served.released == []


def test_a_source_that_is_gone_or_silent_ends_the_pull_with_an_error(served: Served) -> None:
    gone = socket.create_server(("127.0.0.1", 0))
    port = gone.getsockname()[1]
    gone.close()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never answers
    pulling = puller(force_tcp=True)
    try:
        order = served.order("t@1", [1], [0])
        for port_, deadline in ((port, 20.0), (silent.getsockname()[1], 0.3)):
            endpoint = KvEndpoint("127.0.0.1", port_, HOST)
            source = KvSource("t@1", [endpoint], [1], 4, served.layout)
            outcome = pulling.pull(
                PullBlocks("t@1", source, [1], [0], time.monotonic() + deadline), 0
            )
            assert outcome.error is not None
            assert ("refused" if deadline > 1 else "timed out") in outcome.error
        assert "none for rank 1" in (pulling.pull(order, rank=1).error or "")
    finally:
        silent.close()


def test_pulls_from_one_source_reuse_its_connection_until_the_server_ends_it(
    served: Served,
) -> None:
    pulling = puller(force_tcp=True)
    for transfer_id in ("r1", "r2", "r3"):
        served.holds.hold(transfer_id, [1], time.monotonic() + 30)
        if transfer_id == "r3":  # the server side ends the kept connection meanwhile
            served._connections[0].shutdown(socket.SHUT_RDWR)
        assert pulling.pull(served.order(transfer_id, [1], [0]), 0).error is None
    assert len(served._connections) == 2  # one handshake for r1 and r2, one more for r3
    assert served.released == ["r1", "r2", "r3"]


def test_a_pull_quicker_than_its_hold_order_waits_for_it(served: Served) -> None:
    hold = threading.Timer(0.03, served.holds.hold, ("late", [1], time.monotonic() + 30))
    hold.start()
    outcome = puller(force_tcp=True).pull(served.order("late", [1], [0]), 0)
    hold.join(10)
    assert outcome.error is None and served.released == ["late"]


def test_holds_end_at_their_deadline() -> None:
    holds = HoldTable()
    holds.hold("a@0", [1], deadline=100.0)
    holds.hold("b@0", [2], deadline=200.0)

    assert holds.next_deadline() == 100.0
    assert holds.expire(now=150.0) == ["a@0"]
    with pytest.raises(ValueError, match="'b@0' is not held: its hold expired"):
        holds.acknowledge("b@0", now=200.0)
    with pytest.raises(ValueError, match="'a@0' is not held: its hold expired"):
        holds.check("a@0", [1], now=0.0)
    assert len(holds) == 0 and holds.next_deadline() is None


def test_a_puller_lets_go_of_the_segment_of_a_source_that_ended() -> None:
    pulling, first = puller(), Served()
    first.holds.hold("t@1", [1], time.monotonic() + 30)
    assert pulling.pull(first.order("t@1", [1], [0]), 0).error is None
    old = first.segment
    assert mapped(old)
    first.close()  # unlinks the segment; the source run is over
    del first
    second = Served()
    try:
        second.holds.hold("t@2", [1], time.monotonic() + 30)

        assert pulling.pull(second.order("t@2", [1], [0]), 0).error is None

        deadline = time.monotonic() + 10  # the old server's threads let go as they end
        while mapped(old) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert not mapped(old), "a mapping keeps an unlinked cache segment's memory alive"
    finally:
        second.close()


def mapped(segment: str) -> bool:
    """Whether this process maps the segment (still, if it is unlinked: its memory lives)."""
    with open("/proc/self/maps") as maps:
        return any(segment in line for line in maps)


def test_gathered_sends_and_scattered_receives_survive_partial_moves() -> None:
    """Many buffers through small socket buffers: calls stop mid-buffer on both sides."""
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes()

    def cut(sizes: np.ndarray) -> list[int]:
        edges = sorted({0, len(data), *np.cumsum(sizes).tolist()})
        return [edge for edge in edges if edge <= len(data)]

    send_edges = cut(rng.integers(0, 3000, 400))  # zero-length pieces included
    recv_edges = cut(rng.integers(1, 5000, 200))
    received = bytearray(len(data))
    whole = memoryview(received)
    sending, receiving = socket.socketpair()
    for sock in (sending, receiving):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    pieces = [memoryview(data)[a:b] for a, b in itertools.pairwise(send_edges)]
    deadline = time.monotonic() + 30
    sender = threading.Thread(target=send_buffers, args=(sending, pieces, deadline))
    with sending, receiving:
        sender.start()
        targets = [whole[a:b] for a, b in itertools.pairwise(recv_edges)]
        got = recv_into_buffers(receiving, targets, deadline, "the test's stream")
        sender.join(30)

    assert got == len(data) and bytes(received) == data


def test_one_peer_holds_at_most_its_share_of_the_connections(served: Served) -> None:
    """MAX_PER_PEER connections from one address that never finish their handshake hold their
    threads; one more from that address is closed at once, before any handshake, and counted;
    once one of them is gone, an authenticated connection is served again."""
    address = served.listener.getsockname()
    held = [socket.create_connection(address, timeout=10) for _ in range(MAX_PER_PEER)]
    try:
        deadline = time.monotonic() + 5
        while served.server._per_peer.get("127.0.0.1", 0) < MAX_PER_PEER:
            assert time.monotonic() < deadline, served.server._per_peer
            time.sleep(0.01)
        started = time.monotonic()
        with socket.create_connection(address, timeout=10) as extra:
            assert extra.recv(1) == b""  # closed by the server, not by a timeout
        assert time.monotonic() - started < 1.0
        assert served.server.crowded == 1
        held.pop().close()
        deadline = time.monotonic() + 5
        while served.server._per_peer.get("127.0.0.1", 0) >= MAX_PER_PEER:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        request = PullRequest("t@1", [1], served.layout, "another-host", "shm")
        frame = TO_SERVER._encoder.encode(request)
        reply = served.raw_exchange(struct.pack(">I", len(frame)) + frame)
        assert isinstance(reply, WireError), reply  # served: answered, not closed
    finally:
        for sock in held:
            sock.close()
