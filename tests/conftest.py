"""Fixtures every test gets."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.runtime.doorbell import default_doorbell_dir


def _our_ipc_files() -> set[Path]:
    """Segments and doorbells of runs rooted in this process (other runs share /dev/shm)."""
    prefix = f"engine-{os.getpid()}-"
    found: set[Path] = set()
    for directory in (Path("/dev/shm"), Path(default_doorbell_dir())):
        if directory.is_dir():
            found.update(path for path in directory.iterdir() if path.name.startswith(prefix))
    return found


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """Fail a test that leaves shared-memory segments or doorbells behind (and remove them)."""
    before = _our_ipc_files()
    yield
    left = sorted(_our_ipc_files() - before)
    for path in left:
        path.unlink(missing_ok=True)
    assert not left, f"the test left {len(left)} segment(s)/doorbell(s) behind: {left}"
