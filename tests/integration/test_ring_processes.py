"""Rings between real spawned processes: integrity, backpressure, broadcast, crashes, cleanup."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.runtime.doorbell import default_doorbell_dir
from engine.runtime.ring import (
    RECORD_OVERHEAD,
    RingReader,
    RingSpec,
    RingWriter,
    create_ring,
    destroy_ring,
    run_prefix,
)
from engine.runtime.shm import SHM_DIR

TIMEOUT_S = 60.0
SPAWN = mp.get_context("spawn")
MakeRing = Callable[..., RingSpec]


# -- child processes (module level: `spawn` imports them by name) -----------------------------


def _report(conn: Connection, result: Any) -> None:
    conn.send_bytes(msgspec.msgpack.encode(result))


def echo_child(inbound: RingSpec, outbound: RingSpec, stop: bytes) -> None:
    """Send every frame of `inbound` back on `outbound`, in the batches it arrives in."""

    async def main() -> None:
        with RingReader(inbound) as reader, RingWriter(outbound) as writer:
            while True:
                frames = await reader.recv_many()
                if frames[-1] == stop:
                    return
                await writer.send_many(frames)

    uvloop.run(main())


def numbered_producer(spec: RingSpec, count: int, batch: int, conn: Connection) -> None:
    """Write `count` numbered frames in batches; report how often the ring was found full."""

    async def main() -> None:
        found_full = 0
        with RingWriter(spec) as writer:
            for first in range(0, count, batch):
                frames = [_numbered(i) for i in range(first, min(first + batch, count))]
                written = writer.try_send_many(frames)
                if written < len(frames):
                    found_full += 1
                    await writer.send_many(frames[written:])
        _report(conn, found_full)

    uvloop.run(main())


def digesting_reader(
    spec: RingSpec, reader: int, count: int, pause_s: float, conn: Connection
) -> None:
    """Read `count` frames, pausing after each drain; report (count, sha256 of them all)."""

    async def main() -> None:
        digest = hashlib.sha256()
        seen = 0
        with RingReader(spec, reader) as ring:
            _report(conn, "ready")
            while seen < count:
                frames = await ring.recv_many()
                for frame in frames:
                    digest.update(len(frame).to_bytes(4, "little") + frame)
                seen += len(frames)
                await asyncio.sleep(pause_s)
        _report(conn, [seen, digest.hexdigest()])

    uvloop.run(main())


def checksummed_producer(spec: RingSpec, seed: int) -> None:
    """Write self-checking frames of random sizes until killed."""
    rng = random.Random(seed)
    with RingWriter(spec) as writer:
        seq = 0
        while True:
            batch = []
            for _ in range(rng.randint(1, 4)):
                batch.append(_checksummed(seq, rng.randbytes(rng.randint(0, 100_000))))
                seq += 1
            sent = 0
            while sent < len(batch):
                sent += writer.try_send_many(batch[sent:])


def _numbered(i: int) -> bytes:
    return i.to_bytes(8, "little") * (1 + i % 7)


def _checksummed(seq: int, payload: bytes) -> bytes:
    body = seq.to_bytes(8, "little") + payload
    return hashlib.sha256(body).digest() + body


def _check_checksummed(frame: bytes) -> int:
    """The frame's sequence number; fails if the frame is torn or altered."""
    assert len(frame) >= 40, f"a {len(frame)}-byte frame is shorter than its own header"
    assert hashlib.sha256(frame[32:]).digest() == frame[:32], "frame fails its checksum"
    return int.from_bytes(frame[32:40], "little")


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def make_ring() -> Iterator[MakeRing]:
    prefix = run_prefix()
    specs: list[RingSpec] = []

    def make(name: str, capacity: int, readers: int = 1) -> RingSpec:
        spec = RingSpec(f"{prefix}{name}", capacity, readers)
        create_ring(spec)
        specs.append(spec)
        return spec

    yield make
    for spec in specs:
        destroy_ring(spec)
    leftovers = [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    leftovers += [name for name in os.listdir(default_doorbell_dir()) if name.startswith(prefix)]
    assert leftovers == []


@pytest.fixture
def children() -> Iterator[Callable[..., Any]]:
    """Starts spawned processes; kills whichever of them are still alive afterwards."""
    started: list[Any] = []

    def start(target: Callable[..., None], *args: Any) -> Any:
        process = SPAWN.Process(target=target, args=args, daemon=True)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(TIMEOUT_S)


def _result(conn: Connection) -> Any:
    assert conn.poll(TIMEOUT_S), "child sent no result in time"
    return msgspec.msgpack.decode(conn.recv_bytes())


# -- tests ------------------------------------------------------------------------------------

CAPACITY = 512
MAX_FRAME = CAPACITY - RECORD_OVERHEAD
frame_sizes = st.one_of(
    st.integers(0, MAX_FRAME), st.sampled_from([0, 1, MAX_FRAME - 1, MAX_FRAME])
)


def test_every_frame_crosses_two_processes_once_in_order_intact(
    make_ring: MakeRing, children: Callable[..., Any]
) -> None:
    there, back = make_ring("there", CAPACITY), make_ring("back", CAPACITY)
    stop = os.urandom(32)
    echo = children(echo_child, there, back, stop)
    writer, reader = RingWriter(there), RingReader(back)

    async def round_trip(batches: list[list[bytes]]) -> list[bytes]:
        expected = sum(len(batch) for batch in batches)

        async def send() -> None:
            for batch in batches:
                await (writer.send(batch[0]) if len(batch) == 1 else writer.send_many(batch))

        sending = asyncio.ensure_future(send())
        received: list[bytes] = []
        while len(received) < expected:
            received += await asyncio.wait_for(reader.recv_many(), timeout=TIMEOUT_S)
        await asyncio.wait_for(sending, timeout=TIMEOUT_S)
        return received

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        st.lists(st.lists(frame_sizes, min_size=1, max_size=12), min_size=1, max_size=8),
        st.integers(0, 2**32),
    )
    def frames_survive(sizes: list[list[int]], seed: int) -> None:
        rng = random.Random(seed)
        batches = [[rng.randbytes(size) for size in batch] for batch in sizes]
        received = asyncio.run(round_trip(batches))
        assert received == [frame for batch in batches for frame in batch]

    try:
        frames_survive()
        asyncio.run(asyncio.wait_for(writer.send(stop), timeout=TIMEOUT_S))
        echo.join(TIMEOUT_S)
        assert echo.exitcode == 0
    finally:
        writer.close()
        reader.close()


async def test_a_full_ring_makes_the_producer_wait_and_loses_nothing(
    make_ring: MakeRing, children: Callable[..., Any]
) -> None:
    spec = make_ring("full", 1024)
    results, child_end = SPAWN.Pipe(duplex=False)
    count = 3000
    producer = children(numbered_producer, spec, count, 25, child_end)
    received: list[bytes] = []
    with RingReader(spec) as reader:
        while len(received) < count:
            received += await asyncio.wait_for(reader.recv_many(), timeout=TIMEOUT_S)
            if len(received) < count // 2:
                await asyncio.sleep(0.001)  # a slow consumer for the first half
    assert received == [_numbered(i) for i in range(count)]
    assert _result(results) > 0  # the producer did find the ring full, and waited
    producer.join(TIMEOUT_S)
    assert producer.exitcode == 0


async def test_broadcast_readers_each_see_every_frame_one_of_them_slow(
    make_ring: MakeRing, children: Callable[..., Any]
) -> None:
    spec = make_ring("fanout", 2048, readers=3)
    count = 1500
    frames = [_numbered(i) for i in range(count)]
    digest = hashlib.sha256()
    for frame in frames:
        digest.update(len(frame).to_bytes(4, "little") + frame)
    pipes = []
    for reader, pause_s in enumerate((0.0, 0.0, 0.002)):
        results, child_end = SPAWN.Pipe(duplex=False)
        children(digesting_reader, spec, reader, count, pause_s, child_end)
        pipes.append(results)
    assert [_result(results) for results in pipes] == ["ready"] * 3
    with RingWriter(spec) as writer:
        for first in range(0, count, 10):
            for frame in frames[first : first + 10]:
                await asyncio.wait_for(writer.send(frame), timeout=TIMEOUT_S)
    assert [_result(results) for results in pipes] == [[count, digest.hexdigest()]] * 3


async def test_a_producer_killed_mid_stream_leaves_only_whole_frames(
    make_ring: MakeRing, children: Callable[..., Any]
) -> None:
    spec = make_ring("killed", 1 << 20)
    producer = children(checksummed_producer, spec, 7)
    received = 0
    with RingReader(spec) as reader:
        while received < 200:
            for frame in await asyncio.wait_for(reader.recv_many(), timeout=TIMEOUT_S):
                assert _check_checksummed(frame) == received
                received += 1
        os.kill(producer.pid, signal.SIGKILL)  # almost surely in the middle of a copy
        producer.join(TIMEOUT_S)
        assert producer.exitcode == -signal.SIGKILL
        for frame in reader.drain():  # what was published before the kill, and nothing else
            assert _check_checksummed(frame) == received
            received += 1
        assert reader.drain() == []


def test_no_resource_tracker_warnings_in_creator_or_attacher(tmp_path: pathlib.Path) -> None:
    script = textwrap.dedent(
        """
        import asyncio, multiprocessing as mp, sys
        from engine.runtime.ring import *

        async def receive(spec):
            with RingReader(spec) as reader:
                assert await asyncio.wait_for(reader.recv_many(), timeout=60) == [b"hello"]

        def attach(spec):
            asyncio.run(receive(spec))

        if __name__ == "__main__":
            spec = RingSpec(sys.argv[1], 4096)
            create_ring(spec)
            try:
                child = mp.get_context("spawn").Process(target=attach, args=(spec,))
                child.start()
                with RingWriter(spec) as writer:
                    asyncio.run(asyncio.wait_for(writer.send(b"hello"), timeout=60))
                child.join(60)
                assert child.exitcode == 0, child.exitcode
            finally:
                destroy_ring(spec)
        """
    )
    name = f"{run_prefix()}tracker"
    (tmp_path / "rings.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "-W", "error", str(tmp_path / "rings.py"), name],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert done.returncode == 0, done.stderr
    assert "resource_tracker" not in done.stderr
    assert "leaked" not in done.stderr
    assert not os.path.exists(os.path.join(SHM_DIR, name))
