"""What a peer without the deployment secret gets from a kv_transfer actor in a real process
(one generic refusal, counted and logged once), what a source with the secret cannot make a
puller map (a path, a file of another size), and TLS between two actors. The attacker here is
written from the wire format: length-prefixed msgpack frames over a raw socket."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from engine.kv.transfer.handshake import admit_puller, prove_to_server
from engine.kv.transfer.host import host_id
from engine.kv.transfer.wire import TO_PULLER, TO_SERVER
from engine.messages.kv_transfer import (
    BlocksPulled,
    BlocksReleased,
    ConnectionsRefused,
    HoldBlocks,
    KvEndpoint,
    KvSource,
    PullBlocks,
    TransferEndpoint,
)
from engine.messages.kv_wire import (
    Acknowledge,
    Challenge,
    HandshakeToPuller,
    PullRequest,
    ShmGrant,
    WireError,
)
from engine.runtime.shm import create_segment, run_prefix, unlink_segment
from tests.integration.test_kv_transfer import KV, LAYOUT, Instance, block, instance, pull_order

SECRET = secrets.token_bytes(32)
WAIT_S = 10.0


def frame(message: msgspec.Struct) -> bytes:
    payload = msgspec.msgpack.encode(message)
    return struct.pack(">I", len(payload)) + payload


def everything_said(port: int, payload: bytes) -> list[object]:
    """Connect, send `payload`, read until the server closes: the frames it sent."""
    received = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        with contextlib.suppress(OSError):  # refused and closed before all was sent
            sock.sendall(payload)
        while chunk := sock.recv(65536):
            received += chunk
    decoder = msgspec.msgpack.Decoder(HandshakeToPuller)
    frames, offset = [], 0
    while offset < len(received):
        (length,) = struct.unpack_from(">I", received, offset)
        frames.append(decoder.decode(received[offset + 4 : offset + 4 + length]))
        offset += 4 + length
    return frames


def acknowledge_with(port: int, secret: bytes, transfer_id: str) -> list[object]:
    """A handshake with `secret`, then an Acknowledge: the frames after the challenge."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        with contextlib.suppress(Exception):  # a refused proof ends here
            prove_to_server(sock, secret, time.monotonic() + WAIT_S)
            TO_SERVER.send(sock, Acknowledge(transfer_id), time.monotonic() + WAIT_S)
            return [TO_PULLER.receive(sock, time.monotonic() + WAIT_S)]
        return ["refused"]


async def refused_count(source: Instance, expected: int) -> int:
    counted = 0
    while counted < expected:
        counted += (await source.next_event(ConnectionsRefused)).count
    return counted


async def test_a_peer_without_the_secret_learns_nothing_and_the_real_pull_still_succeeds(
    capfd: pytest.CaptureFixture[str],
) -> None:
    async with (
        instance(secret=SECRET) as source,
        instance(force_tcp=True, secret=SECRET) as destination,
    ):
        source.cache[:] = np.random.default_rng(2).integers(0, 256, source.cache.size, np.uint8)
        endpoint = await source.next_event(TransferEndpoint)
        await destination.next_event(TransferEndpoint)
        transfer_id = secrets.token_hex(16)
        src, dst = [3, 4, 5], [7, 8, 9]
        await source.order(HoldBlocks(transfer_id, src, time.monotonic() + 60))
        port = endpoint.endpoint.port
        here = host_id()

        pull = frame(PullRequest(transfer_id, src, LAYOUT, here, "tcp"))
        probe = frame(PullRequest(transfer_id, [LAYOUT.num_blocks + 5], LAYOUT, here, "shm"))
        garbage = struct.pack(">I", 60) + bytes(60)
        for attempt in (pull, probe, frame(Acknowledge(transfer_id)), garbage):
            said = everything_said(port, attempt)
            assert len(said) == 2 and isinstance(said[0], Challenge), said
            assert said[1] == WireError("refused")
        assert acknowledge_with(port, secrets.token_bytes(32), transfer_id) == ["refused"]

        await destination.order(pull_order(transfer_id, endpoint, src, dst, timeout=60))
        pulled = await destination.next_event(BlocksPulled)
        released = await source.next_event(BlocksReleased)
        assert pulled.error is None, pulled.error
        assert released == BlocksReleased(transfer_id, 0)
        assert block(destination.cache, 1, 1, 9) == block(source.cache, 1, 1, 5)
        assert await refused_count(source, 5) == 5
    warnings = [line for line in capfd.readouterr().err.splitlines() if "refused" in line]
    assert len(warnings) == 1 and "127.0.0.1" in warnings[0], warnings  # once per peer a minute


class FakeSource:
    """A listener that proves the secret, then grants whatever segment name it is given."""

    def __init__(self, segment: str) -> None:
        self.segment = segment
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(WAIT_S)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError), self.listener.accept()[0] as sock:
            if admit_puller(sock, SECRET):
                TO_SERVER.receive(sock, time.monotonic() + WAIT_S)
                TO_PULLER.send(sock, ShmGrant(self.segment, LAYOUT), time.monotonic() + WAIT_S)
                sock.recv(1)  # until the puller closes

    def close(self) -> None:
        self.listener.close()
        self.thread.join(WAIT_S)


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A file of exactly the cache's size, outside /dev/shm."""
    path = tmp_path / "victim"
    path.write_bytes(b"\x07" * LAYOUT.segment_bytes)
    yield path


def mapped_by(pid: int, needle: str) -> bool:
    return needle in Path(f"/proc/{pid}/maps").read_text()


async def test_a_grant_naming_a_path_or_a_file_of_another_size_is_refused_unmapped(
    victim: Path,
) -> None:
    prefix = run_prefix()
    small, link = f"{prefix}fake", f"{prefix}link"
    create_segment(small, 4096)
    os.symlink(victim, f"/dev/shm/{link}")
    grants = {
        str(victim): "is not a segment name",
        f"../..{victim}": "is not a segment name",
        f"engine-x/../..{victim}": "is not a segment name",
        link: "cannot be opened",  # a link, not followed
        small: f"is 4096 bytes, but a cache of its layout (64 blocks) takes {LAYOUT.segment_bytes}",
    }
    try:
        async with instance(secret=SECRET) as destination:
            await destination.next_event(TransferEndpoint)
            pid = destination.run.pid(KV)
            for segment, says in grants.items():
                fake = FakeSource(segment)
                try:
                    endpoint = KvEndpoint("127.0.0.1", fake.port, host_id())
                    source = KvSource("t", [endpoint], [1], 16, LAYOUT)
                    order = PullBlocks("t", source, [1], [2], time.monotonic() + WAIT_S)
                    await destination.order(order)
                    pulled = await destination.next_event(BlocksPulled)
                finally:
                    fake.close()
                assert pulled.error is not None and says in pulled.error, (segment, pulled.error)
                assert not mapped_by(pid, str(victim)) and not mapped_by(pid, small)
            assert block(destination.cache, 0, 0, 2) == bytes(LAYOUT.chunk_bytes)
    finally:
        unlink_segment(small)
        os.unlink(f"/dev/shm/{link}")


def make_certificates(directory: Path) -> dict[str, str]:
    """A CA and one certificate it signed (both ends of a test present the same one)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ca_key, ca, key, request, cert = (
        str(directory / name) for name in ("ca.key", "ca.pem", "kv.key", "kv.csr", "kv.pem")
    )
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        ca_key,
        "-out",
        ca,
        "-days",
        "1",
        "-subj",
        "/CN=test kv CA",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        key,
        "-out",
        request,
        "-subj",
        "/CN=kv_transfer",
    )
    openssl(
        "x509",
        "-req",
        "-in",
        request,
        "-CA",
        ca,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-out",
        cert,
        "-days",
        "1",
    )
    return {"tls_cert": cert, "tls_key": key, "tls_ca": ca}


async def test_pulls_run_inside_tls_and_a_peer_without_a_certificate_is_refused(
    tmp_path: Path,
) -> None:
    tls = make_certificates(tmp_path)
    async with (
        instance(secret=SECRET, **tls) as source,
        instance(force_tcp=True, secret=SECRET, **tls) as destination,
        instance(force_tcp=True, secret=SECRET) as plain,
    ):
        source.cache[:] = np.random.default_rng(4).integers(0, 256, source.cache.size, np.uint8)
        endpoint = await source.next_event(TransferEndpoint)
        for side in (destination, plain):
            await side.next_event(TransferEndpoint)
        await source.order(HoldBlocks("tls", [1, 2], time.monotonic() + 60))

        # It waits for a challenge the TLS server never sends in clear: its deadline ends it.
        await plain.order(pull_order("tls", endpoint, [1, 2], [5, 6], timeout=1.0))
        refused = await plain.next_event(BlocksPulled)
        await destination.order(pull_order("tls", endpoint, [1, 2], [5, 6], timeout=60))
        pulled = await destination.next_event(BlocksPulled)

        assert refused.error is not None
        assert pulled.error is None and pulled.via == "tcp", pulled.error
        assert block(destination.cache, 3, 0, 6) == block(source.cache, 3, 0, 2)
        assert await refused_count(source, 1) == 1
