"""The Actor base in a real child process: clean stops, bad frames, its entry and its lifecycle."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from engine.runtime.actor import load_actor_class
from engine.runtime.child_spec import Restart
from engine.runtime.events import ChildDied
from engine.runtime.supervisor import ChildStartError, Supervisor
from tests.integration.sample_actors import (
    EVENT_TIMEOUT,
    EchoActor,
    async_wait_until,
    child,
    echo_config,
    echo_rings,
    supervised,
    supervisor_spec,
)


async def test_an_actor_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    stop_log = tmp_path / "stops"
    spec = supervisor_spec(
        child("job", restart=Restart.TRANSIENT, config=echo_config(stop_log=str(stop_log))),
        child("other"),
    )
    async with supervised(spec) as run:
        os.kill(run.pid("job"), signal.SIGTERM)
        died = await run.next(ChildDied, "job")

        assert died.exitcode == 0 and "SIGTERM" in died.reason
        assert stop_log.read_text().split() == ["job"]  # on_stop ran
        # transient, exited normally: not restarted
        assert run.row("job").state == "exited" and run.row("job").restarts == 0


async def test_a_malformed_frame_is_logged_and_counted_and_the_actor_keeps_serving(
    capfd: pytest.CaptureFixture[str],
) -> None:
    async with supervised(supervisor_spec(child("echo"), rings=echo_rings())) as run:
        assert await run.supervisor.root.send_many("in", [b"\xc1 not msgpack"])
        assert await run.roundtrip("still here") == "echo:still here"
        await async_wait_until(
            lambda: run.row("echo").decode_errors == 1, EVENT_TIMEOUT, "a heartbeat counting it"
        )

    log = capfd.readouterr().err
    assert "channel test-notes: dropped a malformed frame" in log
    assert f"echo[{next(iter(run.pids))}]" in log  # child logs carry the actor's name and pid


async def test_a_childs_log_level_changes_while_it_runs(capfd: pytest.CaptureFixture[str]) -> None:
    captured: list[str] = []

    def applied() -> bool:
        captured.append(capfd.readouterr().err)
        return "log level set to DEBUG" in "".join(captured)

    async with supervised(supervisor_spec(child("echo"))) as run:
        with pytest.raises(ValueError, match=r"log level must be one of .* got 'LOUD'"):
            run.supervisor.set_log_level("LOUD")
        run.supervisor.set_log_level("DEBUG")
        await async_wait_until(applied, EVENT_TIMEOUT, "the child to apply the level")


async def test_a_child_whose_entry_is_no_actor_fails_start_up_naming_it() -> None:
    spec = supervisor_spec(child("bogus", entry="tests.integration.sample_actors:Note"))
    supervisor = Supervisor(spec)

    with pytest.raises(ChildStartError, match=r"child 'bogus' exited with status 1"):
        await supervisor.start()

    assert "start-up failed" in await supervisor.wait_closed()


def test_an_actor_entry_names_an_actor_subclass() -> None:
    assert load_actor_class("tests.integration.sample_actors:EchoActor") is EchoActor
    with pytest.raises(ValueError, match="'module:Class'"):
        load_actor_class("tests.integration.sample_actors")
    with pytest.raises(TypeError, match="must name an Actor subclass"):
        load_actor_class("tests.integration.sample_actors:Note")
