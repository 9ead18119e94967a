"""Files in shared places (engine/runtime/private_files.py, engine/runtime/shm.py): a run's
segments live in a directory nobody else can write, names someone else took are never used, and
what is opened there is checked (owner, mode, kind, no link) before use.

Checks of a file made by another user run where the tests run as root (they chown one to
`nobody`, or act as `nobody` in a child process); elsewhere they are skipped with the reason."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.runtime import shm
from engine.runtime.private_files import (
    ForeignFileError,
    TakenNameError,
    create_private,
    open_private,
)
from engine.runtime.shm import (
    SHM_DIR,
    create_segment,
    open_segment,
    run_directory,
    run_prefix,
    segment_path,
    unlink_segment,
)

NOBODY = 65534
as_root = pytest.mark.skipif(
    os.getuid() != 0, reason="needs root, to make a file owned by another uid (nobody)"
)


@pytest.fixture
def name() -> Iterator[str]:
    """A segment name in this process's run directory, removed afterwards."""
    name = f"{run_prefix()}probe"
    yield name
    unlink_segment(name)


def test_another_user_cannot_put_a_file_in_the_run_directory() -> None:
    """The attack on the weight store: another account pre-creates the name a worker maps."""
    directory = Path(SHM_DIR) / run_directory()
    info = directory.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    if os.getuid() != 0:
        pytest.skip("needs root, to act as another uid (nobody)")
    planted = directory / "weights-0123456789abcdef0123"
    attempt = subprocess.run(
        ["/bin/sh", "-c", f"echo forged > {planted}"], user=NOBODY, capture_output=True, timeout=30
    )
    assert attempt.returncode != 0 and b"ermission denied" in attempt.stderr
    assert not planted.exists()


@as_root
def test_a_segment_name_taken_by_another_user_is_refused_naming_its_owner(name: str) -> None:
    path = segment_path(name)
    Path(path).write_bytes(b"\0" * 4096)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(TakenNameError, match=rf"{path} exists already, owned by .*uid {NOBODY}"):
        create_segment(name, 4096)
    with pytest.raises(ForeignFileError, match=rf"refusing {path}: owned by .*uid {NOBODY}"):
        open_segment(name, 4096)


def test_a_link_a_fifo_or_a_file_others_can_read_is_refused(name: str, tmp_path: Path) -> None:
    path = segment_path(name)
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * 4096)
    os.symlink(victim, path)
    with pytest.raises(ForeignFileError, match="a symbolic link"):
        open_segment(name, 4096)
    with pytest.raises(TakenNameError, match="exists already"):
        create_private(path)  # never follows the link to create or truncate its target
    assert victim.read_bytes() == b"\0" * 4096
    os.unlink(path)
    os.mkfifo(path, 0o600)
    with pytest.raises(ForeignFileError, match="not a regular file"):
        open_segment(name, 4096)  # and never blocks on it
    os.unlink(path)
    create_segment(name, 4096).close()
    os.chmod(path, 0o644)
    with pytest.raises(ForeignFileError, match="mode 0644 lets other users in"):
        open_private(path)


def test_a_run_directory_name_someone_holds_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = iter(["00000000deadbeef", "00000000cafef00d"])
    monkeypatch.setattr(shm.secrets, "token_hex", lambda _: next(tokens))
    monkeypatch.setattr(shm, "_run_directory", "")
    taken = Path(SHM_DIR) / f"engine-{os.getpid()}-00000000deadbeef"
    taken.mkdir(mode=0o755)
    try:
        if os.getuid() == 0:
            os.chown(taken, NOBODY, NOBODY)
        chosen = run_directory()
        assert chosen == f"engine-{os.getpid()}-00000000cafef00d"
        os.rmdir(segment_path(chosen))
    finally:
        taken.rmdir()
