"""The start-up check that a run's rings and segments fit in /dev/shm (a tmpfs that would
otherwise SIGBUS the first process to write past its free space)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from engine.runtime.child_process import CONTROL_RING_BYTES
from engine.runtime.child_spec import ChildSpec, RingDecl, SegmentDecl, SupervisorSpec
from engine.runtime.shm import header_bytes
from engine.runtime.shm_space import (
    ShmNeed,
    ShmSpaceError,
    check_shm_space,
    shm_free,
    shm_need,
)

GIB = 1 << 30


def _spec(segment_bytes: int) -> SupervisorSpec:
    children = tuple(ChildSpec(name=n, entry="x:Y") for n in ("a", "b"))
    rings = (
        RingDecl(name="one", writer="a", readers=("b",), capacity=1 << 20),
        RingDecl(name="two", writer="b", readers=("a", "root"), capacity=4096),
    )
    segments = (SegmentDecl(name="kv-cache0", size=segment_bytes, parties=("a", "b")),)
    return SupervisorSpec(children=children, rings=rings, segments=segments)


def test_the_need_counts_every_ring_control_ring_and_segment_of_every_replica() -> None:
    need = shm_need([_spec(3 * GIB), _spec(GIB)])
    rings = header_bytes(1) + (1 << 20) + header_bytes(2) + 4096
    control = 2 * 2 * (header_bytes(1) + CONTROL_RING_BYTES)  # two children, two rings each
    assert need == ShmNeed(rings=2 * (rings + control), segments=4 * GIB)


def test_a_run_that_does_not_fit_is_refused_in_one_line_naming_both_figures() -> None:
    need = ShmNeed(rings=64 << 20, segments=4 * GIB)
    with pytest.raises(ShmSpaceError) as refused:
        check_shm_space(need, free=GIB, remedy=("lower cache.kv_cache_memory",))
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        "/dev/shm has 1.0 GiB free but this run needs 4.1 GiB of shared memory there "
        "(segments 4.0 GiB, rings 64.0 MiB); lower cache.kv_cache_memory or enlarge /dev/shm"
    )
    check_shm_space(need, free=need.total)  # exactly enough: no error


def test_free_space_leaves_out_what_other_runs_segments_claimed_and_never_touched() -> None:
    directory = Path(tempfile.mkdtemp(dir="/dev/shm"))  # a tmpfs, as segments live on
    try:
        raw_before, before = _raw_free(directory), shm_free(str(directory))
        with open(directory / "engine-1-abcd-s.kv-cache0", "wb") as sparse:
            sparse.truncate(GIB)  # sparse, as a segment is: the filesystem counts none of it used
            sparse.write(b"x" * 4096)  # one touched page: no longer a claim but a use
        with open(directory / "not-ours", "wb") as other:
            other.truncate(GIB)  # not an engine segment: not counted
        raw_drop = raw_before - _raw_free(directory)
        drop = before - shm_free(str(directory))
    finally:
        shutil.rmtree(directory)
    slack = 64 << 20  # other processes use the same filesystem meanwhile
    assert abs(raw_drop) < slack  # what statvfs alone would have let a run take
    assert GIB - slack <= drop <= GIB + slack


def _raw_free(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize
