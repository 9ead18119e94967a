"""Fixtures every test gets."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest

from engine.launch import kv_disk_plan
from engine.runtime.shm import release_run_directory
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


@pytest.fixture(autouse=True, scope="session")
def fresh_kv_disk_tier() -> Iterator[None]:
    """Engines the tests start keep their prefix cache's disk tier in a directory of this session,
    not the engine home's (a prompt an earlier run sent is no hit in this one): servers through
    the environment, the library (which plans in this process) through the plan's default."""
    tier = tempfile.mkdtemp(prefix="engine-test-kv-disk-")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ENGINE_CACHE__KV_DISK_PATH", tier)
        patch.setattr(kv_disk_plan, "TIER_DIRECTORY", tier)  # absolute: the home is not used
        yield
    shutil.rmtree(tier, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def own_run_directory_removed() -> Iterator[None]:
    """The run directory the tests' own process made in /dev/shm (library engines, stores) goes
    with the session, as a server's goes with the server."""
    yield
    release_run_directory()
