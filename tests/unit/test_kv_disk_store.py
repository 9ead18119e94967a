"""The disk tier's files (engine/kv/disk/store.py): written whole and exclusively, owner-only;
read only when they prove to be the block asked for (checksum, key, namespace, size, owner, not
a link), else removed and reported; kept within their size bound least recently used first; a
full disk stops the writes, said once; a tier removed under the server is made again."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from engine.kv.disk import store as store_module
from engine.kv.disk.block_file import HEADER_BYTES, BadBlockFile
from engine.kv.disk.store import DiskStore

NAMESPACE = bytes(range(16))
OTHER_NAMESPACE = bytes(range(1, 17))
BLOCK = 4096  # payload bytes of a block here


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def payload(n: int) -> list[memoryview]:
    """A block's payload in two pieces (as a cache's chunks would be), its bytes a function of n."""
    data = np.random.default_rng(n).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
    return [memoryview(data[: BLOCK // 2]), memoryview(data[BLOCK // 2 :])]


def empty() -> list[memoryview]:
    return [memoryview(bytearray(BLOCK // 2)), memoryview(bytearray(BLOCK // 2))]


def read(store: DiskStore, n: int) -> bytes:
    parts = empty()
    store.read_into(key(n), parts)
    return b"".join(bytes(part) for part in parts)


def test_a_block_comes_back_as_written_from_an_owner_only_file_of_its_own(tmp_path: Path) -> None:
    store = DiskStore(str(tmp_path / "tier"), NAMESPACE, 1 << 20)
    outcome = store.write(key(1), payload(1))
    assert outcome.written == HEADER_BYTES + BLOCK and not outcome.present
    path = Path(store.path(key(1)))
    assert path.name == key(1).hex() + ".kv" and path.parent.name == NAMESPACE.hex()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read(store, 1) == b"".join(bytes(p) for p in payload(1))
    assert store.contains(key(1)) and not store.contains(key(2))
    # Another writer of the same block (another replica) finds it there and writes nothing.
    again = DiskStore(str(tmp_path / "tier"), NAMESPACE, 1 << 20).write(key(1), payload(1))
    assert again.present and again.written == 0
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    with pytest.raises(FileNotFoundError):
        read(store, 2)


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "corrupt":
        flipped = bytes([data[HEADER_BYTES + 100] ^ 0x40])
        path.write_bytes(data[: HEADER_BYTES + 100] + flipped + data[HEADER_BYTES + 101 :])
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "longer":
        path.write_bytes(data + b"\0" * 16)
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize(
    "how",
    [
        "corrupt",
        "truncated",
        "longer",
        "empty",
        "wrong key",
        "other model",
        "mode 0644",
        "link",
        "directory",
    ],
)
def test_a_file_that_is_not_the_block_asked_for_is_dropped_never_served(
    tmp_path: Path, how: str
) -> None:
    tier = str(tmp_path / "tier")
    store = DiskStore(tier, NAMESPACE, 1 << 20)
    store.write(key(1), payload(1))
    path = Path(store.path(key(1)))
    if how == "wrong key":  # block 2's file under block 1's name
        store.write(key(2), payload(2))
        os.replace(store.path(key(2)), path)
    elif how == "other model":  # another namespace's file of the same key, copied in
        other = DiskStore(tier, OTHER_NAMESPACE, 1 << 20)
        other.write(key(1), payload(1))
        os.replace(other.path(key(1)), path)
    elif how == "mode 0644":
        path.chmod(0o644)
    elif how == "link":
        target = tmp_path / "elsewhere"
        os.replace(path, target)
        path.symlink_to(target)
    elif how == "directory":
        path.unlink()
        path.mkdir()
    else:
        damage(path, how)
    with pytest.raises(BadBlockFile):
        read(store, 1)
    assert not os.path.lexists(path), "a bad file is removed"
    assert store.write(key(1), payload(1)).written  # and written again by the next to have it
    assert read(store, 1) == b"".join(bytes(p) for p in payload(1))


def test_the_tier_keeps_its_size_by_evicting_the_least_recently_used_files(tmp_path: Path) -> None:
    file_bytes = HEADER_BYTES + BLOCK
    store = DiskStore(str(tmp_path / "tier"), NAMESPACE, 10 * file_bytes)
    for n in range(10):
        store.write(key(n), payload(n))
        os.utime(store.path(key(n)), (1000 + n, 1000 + n))  # written in order, a second apart
    read(store, 0)  # used now: the newest
    outcome = store.write(key(10), payload(10))
    assert outcome.evicted == 2  # down to 90 % of the bound: 9 files of 11
    kept = {n for n in range(11) if store.contains(key(n))}
    assert kept == {0, *range(3, 11)}
    assert store.used_bytes == 9 * file_bytes


def test_a_full_disk_stops_the_writes_said_once_and_they_resume_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = DiskStore(str(tmp_path / "tier"), NAMESPACE, 1 << 20)
    real_writev = os.writev

    def full(fd: int, buffers: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with caplog.at_level(logging.WARNING, logger=store_module.__name__):
        for n in range(3):
            assert store.write(key(n), payload(n)).written == 0
    assert store.full
    assert len([r for r in caplog.records if "cannot grow" in r.message]) == 1
    assert not any(Path(store.directory).iterdir()), "no temporary is left behind"
    monkeypatch.setattr(os, "writev", real_writev)
    assert store.write(key(0), payload(0)).written == 0  # not before the retry time
    monkeypatch.setattr(store_module, "FULL_RETRY_S", 0.0)
    assert store.write(key(0), payload(0)).written and not store.full
    assert read(store, 0) == b"".join(bytes(p) for p in payload(0))


def test_a_tier_removed_under_the_server_is_made_again(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    store = DiskStore(str(tier), NAMESPACE, 1 << 20)
    store.write(key(1), payload(1))
    for path in Path(store.directory).iterdir():
        path.unlink()
    Path(store.directory).rmdir()
    tier.rmdir()
    assert not store.contains(key(1))
    with pytest.raises(FileNotFoundError):
        read(store, 1)
    assert store.write(key(2), payload(2)).written
    assert read(store, 2) == b"".join(bytes(p) for p in payload(2))


def test_what_a_dead_writer_left_is_swept_and_a_tier_others_may_write_is_refused(
    tmp_path: Path,
) -> None:
    tier = tmp_path / "tier"
    store = DiskStore(str(tier), NAMESPACE, 1 << 20)
    stale = Path(store.directory) / f".{key(1).hex()}.999-1.tmp"
    fresh = Path(store.directory) / f".{key(2).hex()}.998-1.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"half a block")
    os.utime(stale, (1000, 1000))
    DiskStore(str(tier), NAMESPACE, 1 << 20)
    assert not stale.exists() and fresh.exists()  # a live writer's may still be published
    tier.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by it alone"):
        DiskStore(str(tier), NAMESPACE, 1 << 20)
