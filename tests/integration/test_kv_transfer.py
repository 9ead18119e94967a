"""Two instances' kv_transfer actors in real processes, each under its own real Supervisor
(as two instances run), the test process being both schedulers: it fills the source's cache
segment, writes "kv-orders" and reads "kv-events0" of each."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest

from engine.actors.configs import KvTransferConfig
from engine.actors.roles import Role
from engine.messages.kv_transfer import (
    BlocksPulled,
    BlocksReleased,
    HoldBlocks,
    KvEvent,
    KvLayout,
    KvOrder,
    KvSource,
    PullBlocks,
    TransferEndpoint,
)
from engine.messages.ring_catalogue import KV_EVENTS_RING, KV_ORDERS_RING
from engine.runtime.child_spec import ROOT, ChildSpec, RingDecl, SegmentDecl
from engine.runtime.events import ChildReady, ChildRestarted
from engine.runtime.segments import map_segment
from tests.integration.sample_actors import (
    EVENT_TIMEOUT,
    Run,
    async_wait_until,
    supervised,
    supervisor_spec,
)

LAYOUT = KvLayout("TestForCausalLM/L4", 4, 2, 32, 16, "bfloat16", 2, 1, 0, num_blocks=64)
KV = "kv0"
HEARTBEAT_TIMEOUT = 1.0  # the puller's, in the test of a source killed mid-pull
E = TypeVar("E", bound=KvEvent)


class Instance:
    """One instance's kv_transfer actor (rank 0), its cache, and the root's ends of its rings."""

    def __init__(self, run: Run, ready: ChildReady) -> None:
        self.run = run
        self.segment: str = ready.info["cache_segment"]
        self.cache = np.frombuffer(map_segment(self.segment), dtype=np.uint8)
        self.seen: list[KvEvent] = []

    async def order(self, message: KvOrder) -> None:
        assert await self.run.supervisor.root.send_many(
            KV_ORDERS_RING.name, [KV_ORDERS_RING.encode(message)]
        )

    async def next_event(self, kind: type[E]) -> E:
        """The next event of `kind` from the actor (others are kept in `seen`)."""
        while True:
            for index, event in enumerate(self.seen):
                if isinstance(event, kind):
                    del self.seen[index]
                    return event
            received = await asyncio.wait_for(
                self.run.supervisor.root.mailbox.recv(), EVENT_TIMEOUT
            )
            for _, frames in received:
                self.seen.extend(KV_EVENTS_RING.decode_many(frames))


@contextlib.asynccontextmanager
async def instance(
    force_tcp: bool = False, heartbeat_timeout: float = 5.0, **config_fields: Any
) -> AsyncIterator[Instance]:
    """`config_fields`: more of KvTransferConfig (without a secret: this user's secret file)."""
    config = KvTransferConfig(
        rank=0, layout=LAYOUT, cache_segment="cache", force_tcp=force_tcp, **config_fields
    )
    child = ChildSpec(
        name=KV,
        entry="engine.actors.kv_transfer:KvTransferActor",
        role=Role.KV_TRANSFER,
        config=msgspec.msgpack.encode(config),
        shutdown_timeout=2.0,
        ready_timeout=EVENT_TIMEOUT,
        heartbeat_interval=0.1,
        heartbeat_timeout=heartbeat_timeout,
        stopped_timeout=600.0,  # the tests stop (SIGSTOP) a source to hold it, then kill it
    )
    rings = (
        RingDecl(name=KV_ORDERS_RING.name, writer=ROOT, readers=(KV,), capacity=1 << 16),
        RingDecl(name=KV_EVENTS_RING.at(0).name, writer=KV, readers=(ROOT,), capacity=1 << 16),
    )
    segment = SegmentDecl(name="cache", size=LAYOUT.segment_bytes, parties=(KV,))
    async with supervised(supervisor_spec(child, rings=rings, segments=(segment,))) as run:
        yield Instance(run, await run.next(ChildReady, KV))


def block(cache: np.ndarray, layer: int, kv: int, block_id: int) -> bytes:
    """One block's K or V of one layer, at the offset KvLayout's docstring gives."""
    slots = LAYOUT.num_blocks * LAYOUT.block_size + 1
    slot_bytes = LAYOUT.num_kv_heads * LAYOUT.head_dim * LAYOUT.itemsize
    start = ((layer * 2 + kv) * slots + block_id * LAYOUT.block_size) * slot_bytes
    return cache[start : start + LAYOUT.chunk_bytes].tobytes()


def pull_order(
    transfer_id: str, endpoint: TransferEndpoint, src: list[int], dst: list[int], timeout: float
) -> PullBlocks:
    source = KvSource(transfer_id, [endpoint.endpoint], src, len(src) * 16, endpoint.layout)
    return PullBlocks(transfer_id, source, src, dst, time.monotonic() + timeout)


@pytest.mark.parametrize("force_tcp", [False, True], ids=["shm", "tcp"])
async def test_held_blocks_arrive_in_the_pullers_cache_and_the_hold_is_released(
    force_tcp: bool,
) -> None:
    async with instance() as source, instance(force_tcp) as destination:
        source.cache[:] = np.random.default_rng(1).integers(0, 256, source.cache.size, np.uint8)
        endpoint = await source.next_event(TransferEndpoint)
        await destination.next_event(TransferEndpoint)
        src, dst = [3, 4, 5, 9, 40, 41], [10, 11, 2, 3, 60, 61]

        await source.order(HoldBlocks("req-1@0", src, time.monotonic() + 60))
        await destination.order(pull_order("req-1@0", endpoint, src, dst, timeout=60))
        pulled = await destination.next_event(BlocksPulled)
        released = await source.next_event(BlocksReleased)

        assert pulled.error is None, pulled.error
        assert (pulled.transfer_id, pulled.rank) == ("req-1@0", 0)
        assert pulled.via == ("tcp" if force_tcp else "shm")
        assert pulled.num_bytes == len(src) * LAYOUT.block_bytes
        assert released == BlocksReleased("req-1@0", 0)
        for s, d in zip(src, dst, strict=True):
            for layer in range(LAYOUT.num_layers):
                for kv in (0, 1):
                    assert block(destination.cache, layer, kv, d) == block(
                        source.cache, layer, kv, s
                    )
        untouched = block(destination.cache, 0, 0, 0)
        assert untouched == bytes(len(untouched))  # a block nobody pulled into stays zero


async def test_a_pull_of_an_expired_hold_reports_an_error_and_releases_nothing() -> None:
    async with instance() as source, instance(force_tcp=True) as destination:
        endpoint = await source.next_event(TransferEndpoint)

        await source.order(HoldBlocks("req-2@0", [1, 2], time.monotonic() - 1))
        await destination.order(pull_order("req-2@0", endpoint, [1, 2], [1, 2], timeout=60))
        pulled = await destination.next_event(BlocksPulled)

        assert pulled.error is not None and "its hold expired" in pulled.error
        assert not [e for e in source.seen if isinstance(e, BlocksReleased)]


async def test_a_source_killed_during_a_pull_ends_it_with_an_error_then_serves_again() -> None:
    async with (
        instance() as source,
        instance(force_tcp=True, heartbeat_timeout=HEARTBEAT_TIMEOUT) as destination,
    ):
        endpoint = await source.next_event(TransferEndpoint)
        await source.order(HoldBlocks("req-3@0", [1, 2], time.monotonic() + 600))
        pid, puller_pid = source.run.pid(KV), destination.run.pid(KV)
        os.kill(pid, signal.SIGSTOP)  # it answers no more: the pull waits on it

        # A deadline far beyond the test's wait: an error must come from the death, not it.
        await destination.order(pull_order("req-3@0", endpoint, [1, 2], [1, 2], timeout=600))
        await async_wait_until(
            lambda: connected_to(endpoint.endpoint.port), EVENT_TIMEOUT, "the pull to connect"
        )
        # Longer than the puller may go without a heartbeat: its loop beats while it waits.
        await asyncio.sleep(2 * HEARTBEAT_TIMEOUT)
        os.kill(pid, signal.SIGKILL)
        pulled = await destination.next_event(BlocksPulled)
        await source.run.next(ChildRestarted, KV)
        renewed = await source.next_event(TransferEndpoint)

        assert pulled.error is not None and "timed out" not in pulled.error
        assert destination.run.pid(KV) == puller_pid
        assert destination.run.row(KV).restarts == 0
        assert renewed.endpoint.port != 0


async def test_an_actor_with_a_pull_in_flight_stops_when_asked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="engine.runtime.child_process")
    async with instance() as source:
        endpoint = await source.next_event(TransferEndpoint)
        pid = source.run.pid(KV)
        os.kill(pid, signal.SIGSTOP)  # the pull will wait on it until its deadline
        try:
            async with instance(force_tcp=True) as destination:
                await destination.order(pull_order("req-4@0", endpoint, [1], [1], timeout=600))
                await async_wait_until(
                    lambda: connected_to(endpoint.endpoint.port), EVENT_TIMEOUT, "a connection"
                )
        finally:
            os.kill(pid, signal.SIGCONT)

    escalations = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert escalations == []  # the waiting pull did not hold the actor's exit up


async def test_the_supervisor_creates_the_cache_segment_owner_only_and_unlinks_it() -> None:
    async with instance() as only:
        path = Path("/dev/shm") / only.segment
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_size == LAYOUT.segment_bytes
    assert not path.exists()


def connected_to(port: int) -> bool:
    """Whether some local socket has an established connection to `port` (from /proc)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                    return True
    return False
