"""Ring behaviours within one process: framing, wrap-around, limits, waiting, lifecycle."""

from __future__ import annotations

import asyncio
import os
import pathlib
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator

import msgspec
import pytest

from engine.runtime.doorbell import default_doorbell_dir, doorbell_path
from engine.runtime.ring import (
    RECORD_OVERHEAD,
    FrameTooLarge,
    RingClosed,
    RingReader,
    RingSpec,
    RingWriter,
    create_ring,
    destroy_ring,
    run_prefix,
    sweep_stale_segments,
)
from engine.runtime.shm import SHM_DIR

MakeRing = Callable[..., RingSpec]


def _ours(prefix: str) -> list[str]:
    """Segments under `prefix` (in its run directory) and their doorbells."""
    run_dir, _, part = prefix.partition("/")
    segments = os.path.join(SHM_DIR, run_dir)
    names = [name for name in os.listdir(segments) if name.startswith(part)]
    bells = default_doorbell_dir()
    if os.path.isdir(bells):
        flat = prefix.replace("/", "-")
        names += [name for name in os.listdir(bells) if name.startswith(flat)]
    return names


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh run prefix; the test must leave no segment or doorbell behind under it."""
    prefix = run_prefix()
    yield prefix
    assert _ours(prefix) == [], "segments or doorbells left behind"


@pytest.fixture
def make_ring(prefix: str) -> Iterator[MakeRing]:
    specs: list[RingSpec] = []

    def make(capacity: int = 1024, readers: int = 1, name: str = "ring") -> RingSpec:
        spec = RingSpec(f"{prefix}{name}", capacity, readers)
        create_ring(spec)
        specs.append(spec)
        return spec

    yield make
    for spec in specs:
        destroy_ring(spec)


async def test_frames_come_out_in_order_and_byte_identical(make_ring: MakeRing) -> None:
    spec = make_ring(capacity=256)
    frames = [os.urandom(size) for size in (0, 1, 7, 100, 248, 31, 200, 0, 64, 129, 3)]
    received: list[bytes] = []
    with RingWriter(spec) as writer, RingReader(spec) as reader:
        for _ in range(20):  # many laps of a small ring: records straddle the end repeatedly
            for frame in frames:
                await asyncio.wait_for(writer.send(frame), timeout=5)
                received += await asyncio.wait_for(reader.recv_many(), timeout=5)
    assert received == frames * 20


def test_big_frames_survive_many_laps_of_the_ring(make_ring: MakeRing) -> None:
    spec = make_ring(capacity=200_000)
    batches = [[os.urandom(size) for size in sizes] for sizes in ([70_000, 9_000], [150_000])] * 5
    received: list[bytes] = []
    with RingWriter(spec) as writer, RingReader(spec) as reader:
        for batch in batches:  # big records are copied in frame by frame, straddling the end
            sent = 0
            while sent < len(batch):
                sent += writer.try_send_many(batch[sent:])
                received += reader.drain()
    assert received == [frame for batch in batches for frame in batch]


async def test_a_frame_that_exactly_fills_the_ring_fits_after_any_offset(
    make_ring: MakeRing,
) -> None:
    spec = make_ring(capacity=128)
    exact = os.urandom(spec.capacity - RECORD_OVERHEAD)
    with RingWriter(spec) as writer, RingReader(spec) as reader:
        for offset_frame in (b"", b"a", b"abcdefg", os.urandom(50)):
            await asyncio.wait_for(writer.send(offset_frame), timeout=5)
            assert reader.drain() == [offset_frame]
            await asyncio.wait_for(writer.send(exact), timeout=5)
            assert writer.free_bytes() == 0
            assert reader.drain() == [exact]


def test_a_batch_is_written_as_far_as_it_fits(make_ring: MakeRing) -> None:
    spec = make_ring(capacity=100)
    frames = [bytes([i]) * 20 for i in range(6)]  # 4 + 6 * (4 + 20) = 148 bytes: too many
    with RingWriter(spec) as writer, RingReader(spec) as reader:
        written = writer.try_send_many(frames)
        assert 0 < written < len(frames)
        assert writer.try_send_many(frames[written:]) == 0  # full: nothing more, nothing lost
        assert reader.drain() == frames[:written]
        assert writer.try_send_many(frames[written:]) == len(frames) - written
        assert reader.drain() == frames[written:]


async def test_frame_too_large_names_both_sizes_and_sends_nothing(make_ring: MakeRing) -> None:
    spec = make_ring(capacity=256)
    with RingWriter(spec) as writer, RingReader(spec) as reader:
        with pytest.raises(FrameTooLarge) as excinfo:
            writer.try_send_many([b"ok", b"x" * 249])
        assert "249 bytes" in str(excinfo.value)
        assert "capacity 256" in str(excinfo.value)
        assert reader.drain() == []
        with pytest.raises(FrameTooLarge):  # at once: the waiting send does not wait for it
            await asyncio.wait_for(writer.send(b"x" * 1000), timeout=5)


async def test_waits_given_up_by_a_timeout_leave_the_ring_usable(make_ring: MakeRing) -> None:
    spec = make_ring(capacity=64)
    with RingWriter(spec) as writer, RingReader(spec) as reader:
        with pytest.raises(TimeoutError):  # no frame
            await asyncio.wait_for(reader.recv_many(), timeout=0.05)
        await asyncio.wait_for(writer.send(b"x" * 56), timeout=1)  # fills the ring
        with pytest.raises(TimeoutError):  # no room for a 1-byte frame
            await asyncio.wait_for(writer.send(b"y"), timeout=0.05)
        assert await asyncio.wait_for(reader.recv_many(), timeout=1) == [b"x" * 56]


async def test_a_full_ring_makes_send_wait_until_the_reader_catches_up(
    make_ring: MakeRing,
) -> None:
    spec = make_ring(capacity=128)
    frames = [i.to_bytes(4, "little") * 5 for i in range(200)]
    with RingWriter(spec) as writer, RingReader(spec) as reader:
        sending = asyncio.ensure_future(writer.send_many(frames))
        await asyncio.sleep(0.05)
        assert not sending.done()  # waiting for room, without blocking this loop
        received: list[bytes] = []
        while len(received) < len(frames):
            received += await asyncio.wait_for(reader.recv_many(), timeout=10)
        await asyncio.wait_for(sending, timeout=10)
    assert received == frames


async def test_recv_wakes_up_when_a_frame_arrives_after_parking(make_ring: MakeRing) -> None:
    spec = make_ring()
    with RingWriter(spec) as writer, RingReader(spec, max_spin_us=0) as reader:
        receiving = asyncio.ensure_future(reader.recv())
        await asyncio.sleep(0.02)  # long enough to park
        await writer.send(b"hello")
        assert await asyncio.wait_for(receiving, timeout=5) == b"hello"
        await writer.send_many([b"a", b"b"])
        assert [await reader.recv(), await reader.recv()] == [b"a", b"b"]


async def test_closing_a_writer_wakes_its_waiting_send_with_ring_closed(
    make_ring: MakeRing,
) -> None:
    spec = make_ring(capacity=64)
    with RingReader(spec) as reader:
        writer = RingWriter(spec)
        await asyncio.wait_for(writer.send(b"x" * 56), timeout=5)  # fills the ring
        sending = asyncio.ensure_future(writer.send(b"more"))
        await asyncio.sleep(0.02)
        writer.close()
        with pytest.raises(RingClosed):
            await asyncio.wait_for(sending, timeout=5)
        assert reader.drain() == [b"x" * 56]


async def test_a_cancelled_send_leaves_the_ring_usable(make_ring: MakeRing) -> None:
    spec = make_ring(capacity=64)
    with RingWriter(spec) as writer, RingReader(spec) as reader:
        await asyncio.wait_for(writer.send(b"x" * 56), timeout=5)  # fills the ring
        sending = asyncio.ensure_future(writer.send(b"later"))
        await asyncio.sleep(0.02)
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending
        assert reader.drain() == [b"x" * 56]
        await asyncio.wait_for(writer.send(b"after"), timeout=5)
        assert await asyncio.wait_for(reader.recv(), timeout=5) == b"after"


def test_broadcast_writer_is_bounded_by_the_slowest_reader(make_ring: MakeRing) -> None:
    spec = make_ring(capacity=256, readers=3)
    frames = [bytes([i]) * 40 for i in range(30)]
    with RingWriter(spec) as writer:
        readers = [RingReader(spec, i) for i in range(3)]
        received: list[list[bytes]] = [[], [], []]
        sent = 0
        while sent < len(frames):
            written = writer.try_send_many(frames[sent:])
            if written == 0:
                assert received[2] == frames[: len(received[2])]  # the slow one holds us back
                received[2] += readers[2].drain()
            sent += written
            for i in (0, 1):
                received[i] += readers[i].drain()
        for i in range(3):
            received[i] += readers[i].drain()
            readers[i].close()
    assert received == [frames, frames, frames]


def test_reader_index_and_spec_are_checked(make_ring: MakeRing, prefix: str) -> None:
    spec = make_ring(readers=2)
    with pytest.raises(ValueError, match=r"reader index must be 0\.\.1"):
        RingReader(spec, 2)
    with pytest.raises(ValueError, match="expected"):
        RingReader(RingSpec(spec.name, spec.capacity, readers=1))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RingWriter(RingSpec(f"{prefix}missing", 1024))


def test_a_missing_doorbell_is_a_clear_error_that_leaks_nothing(make_ring: MakeRing) -> None:
    spec = make_ring(readers=3)
    os.unlink(doorbell_path(spec.doorbell_dir, spec.name, "r2"))
    open_fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError, match=r"doorbell .*\.r2\.bell' does not exist"):
        RingWriter(spec)
    assert len(os.listdir("/proc/self/fd")) == open_fds


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"name": "bad/deep/name", "capacity": 1024}, "ring name"),
        ({"name": "../name", "capacity": 1024}, "ring name"),
        ({"name": "", "capacity": 1024}, "ring name"),
        ({"name": "engine-1-ab-x", "capacity": 10}, "capacity must be"),
        ({"name": "engine-1-ab-x", "capacity": 1024, "readers": 0}, "readers must be"),
        ({"name": "engine-1-ab-x", "capacity": 1024, "doorbell_dir": "rel"}, "absolute path"),
    ],
)
def test_bad_ring_specs_are_refused_with_the_value(
    fields: dict[str, object], complaint: str
) -> None:
    with pytest.raises(ValueError, match=complaint):
        RingSpec(**fields)  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError, match=complaint):
        msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=RingSpec)


def test_segments_are_owner_only_and_destroy_removes_everything(prefix: str) -> None:
    spec = RingSpec(f"{prefix}perm", 1024, readers=2)
    create_ring(spec)
    mode = stat.S_IMODE(os.stat(os.path.join(SHM_DIR, spec.name)).st_mode)
    assert mode == 0o600
    assert stat.S_IMODE(os.stat(default_doorbell_dir()).st_mode) == 0o700
    assert len(_ours(prefix)) == 1 + 3  # segment, writer bell, two reader bells
    destroy_ring(spec)
    destroy_ring(spec)  # idempotent
    assert _ours(prefix) == []


def test_run_prefixes_are_in_a_private_run_directory_named_for_the_root() -> None:
    first, second = run_prefix(), run_prefix()
    assert first != second and first.startswith(f"engine-{os.getpid()}-")
    assert first.partition("/")[0] == second.partition("/")[0]  # one directory per root
    info = os.lstat(os.path.join(SHM_DIR, first.partition("/")[0]))
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()


def test_sweep_removes_rings_of_dead_runs_only(tmp_path: pathlib.Path) -> None:
    # Fake segment files in a private directory: sweeping the real /dev/shm here could remove
    # rings of tests running concurrently that name a made-up root pid.
    shm_dir, bells = tmp_path / "shm", tmp_path / "bells"
    shm_dir.mkdir()
    bells.mkdir(mode=0o700)
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(timeout=30)
    dead_dir = f"engine-{finished.pid}-0123456789abcdef"  # a crashed run's directory
    dead_loose = f"engine-{finished.pid}-beef-r.old"  # a loose segment of an older version
    alive = f"engine-{os.getpid()}-0123456789abcdef"
    for name in (dead_dir, alive):
        (shm_dir / name).mkdir(mode=0o700)
        (shm_dir / name / "1234abcd-r.ring.0").write_bytes(b"")
    for name in (dead_loose, "unrelated-file"):
        (shm_dir / name).write_bytes(b"")
    for name in (dead_dir, alive):
        os.mkfifo(bells / f"{name}-1234abcd-r.ring.0.w.bell", 0o600)
    foreign = f"engine-{finished.pid}-a-directory"  # not a run directory of ours: left alone
    (shm_dir / foreign).mkdir()
    swept = sweep_stale_segments([str(bells)], shm_dir=str(shm_dir))
    assert swept == sorted([dead_dir, dead_loose])
    assert sorted(os.listdir(shm_dir)) == sorted([alive, foreign, "unrelated-file"])
    assert os.listdir(bells) == [f"{alive}-1234abcd-r.ring.0.w.bell"]
