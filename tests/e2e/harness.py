"""`python -m engine serve` for end-to-end tests: started on port 0 (engine/client/ starts it,
reads its ready line and stops it, as for `engine bench` and tools/), its admin socket and HTTP API
at hand with the tests' API key. Only processes started here are ever signalled.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from engine.cli.admin_client import send_command
from engine.client.process import free_port, read_line_starting, spawn_engine, stop_process
from engine.client.servers import READY_RE, EngineServer, ServerFailed, start_engine

__all__ = ["READY_RE", "free_port", "read_line_starting", "spawn_engine", "stop_process"]

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
START_TIMEOUT_S = 180.0


@dataclass
class Server(EngineServer):
    """A started `engine serve`: its admin socket asserted to answer, HTTP with the tests' key."""

    extra: dict[str, Any] = field(default_factory=dict)

    def admin(self, cmd: str, *args: str, timeout: float = 60.0) -> Any:
        reply = self.admin_reply(cmd, *args, timeout=timeout)
        assert reply["ok"], reply
        return reply["result"]

    def admin_reply(self, cmd: str, *args: str, timeout: float = 60.0) -> dict[str, Any]:
        assert self.admin_socket is not None, self.ready_line
        return send_command(self.admin_socket, cmd, list(args), timeout=timeout)

    def http(self, api_key: str | None = API_KEY, **kw: Any) -> httpx.Client:
        return super().http(api_key, **kw)

    def stop(self, timeout: float = 30.0) -> int:
        return stop_process(self.proc, timeout)


@contextmanager
def served(
    args: list[str], log_dir: Path, env: dict[str, str] | None = None, name: str = "server"
) -> Iterator[Server]:
    """A started server (start_server), stopped on leaving, whatever happened."""
    srv = start_server(args, log_dir, env, name)
    try:
        yield srv
    finally:
        srv.stop()


def start_server(
    args: list[str], log_dir: Path, env: dict[str, str] | None = None, name: str = "server"
) -> Server:
    """`python -m engine serve <args>` started and its ready line read; an error carrying the
    server's log if it does not come up."""
    log_path = log_dir / f"{name}.log"
    try:
        started = start_engine(["serve", *args], log_path, env, cwd=REPO, timeout=START_TIMEOUT_S)
    except ServerFailed:
        raise RuntimeError(
            f"server did not start:\n{log_path.read_text(errors='replace')}"
        ) from None
    return Server(**{f.name: getattr(started, f.name) for f in fields(EngineServer)})


def wait_until(predicate: Any, timeout: float = 30.0, interval: float = 0.05) -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last value {last!r})")


def leftover_ipc(pid: int) -> list[Path]:
    """Shared-memory segments and doorbells of a server's run (gone once it has exited)."""
    from engine.runtime.doorbell import default_doorbell_dir

    prefix = f"engine-{pid}-"
    found: list[Path] = []
    for directory in (Path("/dev/shm"), Path(default_doorbell_dir())):
        if directory.is_dir():
            found.extend(p for p in directory.iterdir() if p.name.startswith(prefix))
    return sorted(found)
