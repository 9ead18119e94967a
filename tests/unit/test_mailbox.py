"""Mailbox behaviours: several rings awaited together, drained fairly, swapped in place."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator

import pytest
import uvloop

from engine.runtime.doorbell import default_doorbell_dir
from engine.runtime.mailbox import Mailbox
from engine.runtime.ring import (
    RingClosed,
    RingReader,
    RingSpec,
    RingWriter,
    create_ring,
    destroy_ring,
    run_prefix,
)
from engine.runtime.shm import SHM_DIR

MakeRing = Callable[..., RingSpec]
Batch = list[tuple[str, list[bytes]]]


@pytest.fixture
def make_ring() -> Iterator[MakeRing]:
    prefix = run_prefix()
    specs: list[RingSpec] = []

    def make(name: str, capacity: int = 4096) -> RingSpec:
        spec = RingSpec(f"{prefix}{name}", capacity)
        create_ring(spec)
        specs.append(spec)
        return spec

    yield make
    for spec in specs:
        destroy_ring(spec)
    leftovers = [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    leftovers += [name for name in os.listdir(default_doorbell_dir()) if name.startswith(prefix)]
    assert leftovers == []


async def _recv(mailbox: Mailbox) -> Batch:
    return await asyncio.wait_for(mailbox.recv(), timeout=10)


async def test_frames_from_several_rings_all_arrive(make_ring: MakeRing) -> None:
    specs = {name: make_ring(name) for name in ("tok", "sched", "admin")}
    writers = {name: RingWriter(spec) for name, spec in specs.items()}
    mailbox = Mailbox({name: RingReader(spec) for name, spec in specs.items()})
    expected = {name: [f"{name}-{i}".encode() for i in range(50)] for name in specs}
    try:

        async def produce(name: str) -> None:
            for frame in expected[name]:
                await writers[name].send(frame)
                await asyncio.sleep(0)

        producing = asyncio.gather(*(produce(name) for name in specs))
        received: dict[str, list[bytes]] = {name: [] for name in specs}
        while sum(map(len, received.values())) < 150:
            for name, frames in await _recv(mailbox):
                received[name] += frames
        await producing
        assert received == expected
    finally:
        mailbox.close()
        for writer in writers.values():
            writer.close()


async def test_a_busy_ring_does_not_starve_a_quiet_one(make_ring: MakeRing) -> None:
    busy_spec, quiet_spec = make_ring("busy", capacity=1024), make_ring("quiet")
    busy, quiet = RingWriter(busy_spec), RingWriter(quiet_spec)
    mailbox = Mailbox({"busy": RingReader(busy_spec), "quiet": RingReader(quiet_spec)})

    async def flood() -> None:
        while True:  # keeps the busy ring full: it always has frames
            await busy.send(b"noise" * 10)

    flooding = asyncio.ensure_future(flood())
    try:
        for i in range(5):
            await asyncio.sleep(0.001)  # the flood refills the busy ring meanwhile
            await quiet.send(f"quiet-{i}".encode())
            batch = dict(await _recv(mailbox))
            assert batch["quiet"] == [f"quiet-{i}".encode()]  # the very next receive has it
            assert batch["busy"]  # ... although the busy ring had frames too
    finally:
        flooding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(flooding, timeout=10)
        mailbox.close()
        busy.close()
        quiet.close()


async def test_rings_are_visited_in_rotating_order(make_ring: MakeRing) -> None:
    names = ["a", "b", "c"]
    specs = [make_ring(name) for name in names]
    writers = [RingWriter(spec) for spec in specs]
    mailbox = Mailbox({name: RingReader(spec) for name, spec in zip(names, specs, strict=True)})
    try:
        firsts = []
        for _ in range(3):
            for writer in writers:
                await asyncio.wait_for(writer.send(b"x"), timeout=10)
            batch = await _recv(mailbox)
            assert sorted(name for name, _ in batch) == names
            firsts.append(batch[0][0])
        assert sorted(firsts) == names  # each ring led once: none is always last
    finally:
        mailbox.close()
        for writer in writers:
            writer.close()


async def test_replace_swaps_a_ring_even_while_recv_is_parked(make_ring: MakeRing) -> None:
    old_spec, new_spec = make_ring("old"), make_ring("new")
    old_writer, new_writer = RingWriter(old_spec), RingWriter(new_spec)
    mailbox = Mailbox({"peer": RingReader(old_spec)}, max_spin_us=0)
    try:
        await asyncio.wait_for(old_writer.send(b"before"), timeout=10)
        assert await _recv(mailbox) == [("peer", [b"before"])]
        receiving = asyncio.ensure_future(mailbox.recv())
        await asyncio.sleep(0.02)  # parked on the old ring's doorbell
        old = mailbox.replace("peer", RingReader(new_spec))
        old.close()  # safe right away: the parked recv let go of it
        with pytest.raises(RingClosed):
            old.drain()
        await new_writer.send(b"after")
        assert await asyncio.wait_for(receiving, timeout=10) == [("peer", [b"after"])]
        with pytest.raises(KeyError, match="no ring named 'ghost'"):
            mailbox.replace("ghost", RingReader(new_spec))
    finally:
        mailbox.close()
        old_writer.close()
        new_writer.close()


async def test_remove_and_add_change_what_recv_waits_on(make_ring: MakeRing) -> None:
    first_spec, second_spec = make_ring("first"), make_ring("second")
    first, second = RingWriter(first_spec), RingWriter(second_spec)
    mailbox = Mailbox({"first": RingReader(first_spec)})
    try:
        receiving = asyncio.ensure_future(mailbox.recv())
        await asyncio.sleep(0.02)
        removed = mailbox.remove("first")
        assert removed is not None
        removed.close()
        assert mailbox.remove("first") is None
        mailbox.add("second", RingReader(second_spec))
        with pytest.raises(ValueError, match="already has a ring named 'second'"):
            mailbox.add("second", RingReader(second_spec))
        await asyncio.wait_for(second.send(b"hi"), timeout=10)
        assert await asyncio.wait_for(receiving, timeout=10) == [("second", [b"hi"])]
    finally:
        mailbox.close()
        first.close()
        second.close()


async def test_closing_the_mailbox_ends_a_waiting_recv(make_ring: MakeRing) -> None:
    spec = make_ring("only")
    mailbox = Mailbox({"only": RingReader(spec)})
    receiving = asyncio.ensure_future(mailbox.recv())
    await asyncio.sleep(0.02)
    mailbox.close()
    with pytest.raises(RingClosed):
        await asyncio.wait_for(receiving, timeout=10)


def test_parking_swapping_and_waking_work_on_uvloop(make_ring: MakeRing) -> None:
    """The engine's actors run uvloop: its add_reader must wake a parked mailbox too."""
    first_spec, second_spec = make_ring("uv-first"), make_ring("uv-second")
    first, second = RingWriter(first_spec), RingWriter(second_spec)
    mailbox = Mailbox({"peer": RingReader(first_spec)}, max_spin_us=0)

    async def scenario() -> list[Batch]:
        batches = []
        receiving = asyncio.ensure_future(mailbox.recv())
        await asyncio.sleep(0.02)  # parked
        await first.send(b"one")
        batches.append(await asyncio.wait_for(receiving, timeout=10))
        receiving = asyncio.ensure_future(mailbox.recv())
        await asyncio.sleep(0.02)
        mailbox.replace("peer", RingReader(second_spec)).close()
        await second.send(b"two")
        batches.append(await asyncio.wait_for(receiving, timeout=10))
        return batches

    try:
        assert uvloop.run(scenario()) == [[("peer", [b"one"])], [("peer", [b"two"])]]
    finally:
        mailbox.close()
        first.close()
        second.close()
