"""The root's side of systemd's service protocol (sd_notify), without libsystemd.

Under a unit with Type=notify, systemd passes $NOTIFY_SOCKET (a Unix datagram socket; a leading
'@' names one in the abstract namespace) and, with WatchdogSec, $WATCHDOG_USEC (and
$WATCHDOG_PID, the process it is meant for). The root sends READY=1 once it serves, WATCHDOG=1
from its event loop every half watchdog interval, and STOPPING=1 when it begins to drain. The
pings come from the event loop itself, so a root whose loop is stuck stops pinging and systemd
kills and restarts it, as it does when the root dies (Restart=on-failure): the one fault the
supervisor inside the root cannot see. Outside systemd (no $NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("engine.http")


class ServiceNotifier:
    def __init__(self, address: str | None, watchdog_s: float | None) -> None:
        self.address = address  # the datagram socket's address, None: not under systemd
        self.watchdog_s = watchdog_s  # systemd's watchdog interval, None: no watchdog
        self._failed = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], pid: int) -> ServiceNotifier:
        raw = environ.get("NOTIFY_SOCKET", "")
        address = "\0" + raw[1:] if raw.startswith("@") else raw
        return cls(address or None, watchdog_seconds(environ, pid))

    def notify(self, *fields: str) -> bool:
        """Send one datagram of `fields` ("KEY=value" lines); False if nobody gets it."""
        if self.address is None:
            return False
        message = "\n".join(fields).encode()
        # Non-blocking: a reader that does not keep up must never stall the root's event loop.
        kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        with socket.socket(socket.AF_UNIX, kind) as sock:
            try:
                sock.sendto(message, self.address)
            except OSError as e:  # systemd gone or its queue full: serving goes on regardless
                if not self._failed:
                    log.warning("sd_notify to %r failed (said once): %s", self.address, e)
                self._failed = True
                return False
        return True

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def stopping(self, status: str) -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    async def keep_alive(self) -> None:
        """WATCHDOG=1 every half interval, for as long as the event loop runs this task."""
        if self.address is None or self.watchdog_s is None:
            return
        period = self.watchdog_s / 2
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(period)

    def start_keep_alive(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self.keep_alive(), name="sd-watchdog")


def watchdog_seconds(environ: Mapping[str, str], pid: int) -> float | None:
    """systemd's watchdog interval when it is meant for `pid` (sd_watchdog_enabled's rules)."""
    usec = environ.get("WATCHDOG_USEC", "")
    meant_for = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if meant_for and (not meant_for.isdigit() or int(meant_for) != pid):
        return None
    return int(usec) / 1e6


async def stop_keep_alive(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
