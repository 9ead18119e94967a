"""Fixtures every test gets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ipc_files import ipc_files


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """Fail a test that leaves shared-memory segments or doorbells behind (and remove them)."""
    before = ipc_files()
    yield
    left = sorted(ipc_files() - before)
    for path in left:
        path.unlink(missing_ok=True)
    assert not left, f"the test left {len(left)} segment(s)/doorbell(s) behind: {left}"
