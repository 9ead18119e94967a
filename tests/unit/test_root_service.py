"""The root's service hooks without a server: sd_notify datagrams (engine/http/service_notify.py)
and the pidfile lock (engine/http/pidfile.py)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from engine.http.pidfile import PidFile, PidFileBusy
from engine.http.service_notify import ServiceNotifier, watchdog_seconds


def test_the_watchdog_is_half_systemds_interval_and_only_for_the_pid_it_names() -> None:
    assert watchdog_seconds({"WATCHDOG_USEC": "3000000"}, pid=42) == 3.0
    assert watchdog_seconds({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "42"}, pid=42) == 3.0
    assert watchdog_seconds({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "7"}, pid=42) is None
    assert watchdog_seconds({"WATCHDOG_USEC": "0"}, pid=42) is None
    assert watchdog_seconds({}, pid=42) is None


def test_ready_and_watchdog_pings_reach_an_abstract_notify_socket() -> None:
    name = f"engine-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind("\0" + name)
        systemd.settimeout(10.0)
        environ = {"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "100000"}
        notifier = ServiceNotifier.from_environ(environ, os.getpid())
        notifier.ready("serving http://127.0.0.1:1")
        ready = systemd.recv(4096).decode().splitlines()
        assert ready == ["READY=1", "STATUS=serving http://127.0.0.1:1", f"MAINPID={os.getpid()}"]

        async def ping_a_while() -> None:
            task = notifier.start_keep_alive()
            await asyncio.sleep(0.2)  # pings every 0.05 s
            task.cancel()

        asyncio.run(ping_a_while())
        assert systemd.recv(4096) == b"WATCHDOG=1"
        assert systemd.recv(4096) == b"WATCHDOG=1"
    assert not ServiceNotifier.from_environ({}, os.getpid()).notify("READY=1")  # no systemd


def test_a_held_pidfile_refuses_a_second_holder_and_a_dead_holders_file_is_taken_over(
    tmp_path: Path,
) -> None:
    path = tmp_path / "engine.pid"
    path.write_text("999999\n")  # left by a root that died: nobody holds its lock
    held = PidFile.hold(str(path))
    assert path.read_text() == f"{os.getpid()}\n"
    with pytest.raises(PidFileBusy) as refused:
        PidFile.hold(str(path))  # a second open file description: flock refuses it
    assert str(refused.value) == (
        f"pidfile {path} is held by another engine (pid {os.getpid()}); "
        "stop it or choose another server.pidfile"
    )
    held.release()
    assert not path.exists()
    PidFile.hold(str(path)).release()  # free again
    with pytest.raises(OSError, match=r"cannot open pidfile .*/missing/engine.pid: "):
        PidFile.hold(str(tmp_path / "missing" / "engine.pid"))
