"""The supervisor's figure behind /metrics' engine:ring_occupancy_perc, with a real child
process: a ring whose reader stops reading is reported full by its writer's heartbeat.
(Recovery time, engine:actor_recovery_seconds_total: tests/integration/test_supervisor.py's
restart.)"""

from __future__ import annotations

import asyncio

from engine.runtime.events import ring_traffic
from tests.integration.sample_actors import (
    EVENT_TIMEOUT,
    NOTES,
    Note,
    async_wait_until,
    child,
    echo_rings,
    supervised,
    supervisor_spec,
)


async def test_a_ring_whose_reader_stops_reading_is_reported_full_by_its_writer() -> None:
    # root -in-> echo -out-> root, and the root never reads "out"
    async with supervised(supervisor_spec(child("echo"), rings=echo_rings())) as run:
        assert run.row("echo").ring_fill.get("out", 0.0) == 0.0
        # More than "in" and "out" hold together: "out" fills and echo waits on it.
        notes = [NOTES.encode(Note("x" * 900)) for _ in range(16)]
        sending = asyncio.ensure_future(run.supervisor.root.send_many("in", notes))

        def out_fill() -> float:
            return run.row("echo").ring_fill.get("out", 0.0)

        try:
            # A frame no longer fits: over 3/4 of the ring is unread.
            await async_wait_until(lambda: out_fill() > 0.75, EVENT_TIMEOUT, "out reported full")
            assert out_fill() <= 1.0
            [out] = [r for r in ring_traffic(run.supervisor.status()) if r.ring == "out"]
            assert (out.actor, out.fill) == ("echo", out_fill())
        finally:
            sending.cancel()
