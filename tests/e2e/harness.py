"""Run `python -m engine` as a subprocess for end-to-end tests, and clean it up.

The server is started on port 0 and reports its URL on the one line it prints when ready.
Only processes started here are ever signalled.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine.cli.admin_client import send_command

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
READY_RE = re.compile(
    r"^engine ready: (?P<url>(?:http://|unix:)\S+) \(model (?P<model>[^;]+); "
    r"admin socket (?P<socket>.+)\)$"
)
START_TIMEOUT_S = 180.0


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    model: str
    admin_socket: Path
    log_path: Path
    ready_line: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def admin(self, cmd: str, *args: str, timeout: float = 60.0) -> Any:
        reply = send_command(self.admin_socket, cmd, list(args), timeout=timeout)
        assert reply["ok"], reply
        return reply["result"]

    def admin_reply(self, cmd: str, *args: str, timeout: float = 60.0) -> dict[str, Any]:
        return send_command(self.admin_socket, cmd, list(args), timeout=timeout)

    def http(self, **kw: Any) -> httpx.Client:
        kw.setdefault("timeout", 60.0)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.Client(base_url=self.url, headers=headers, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

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


def stop_process(proc: subprocess.Popen[str], timeout: float) -> int:
    """Terminate (SIGTERM → drain), wait, kill if it will not go; return the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


def spawn_engine(
    command: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """`python -m engine <command>`, not waited for: stdout piped (for its ready line), stderr
    to `log_path`."""
    with open(log_path, "w") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "engine", *command],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )


def start_server(
    args: list[str], log_dir: Path, env: dict[str, str] | None = None, name: str = "server"
) -> Server:
    log_path = log_dir / f"{name}.log"
    proc = spawn_engine(["serve", *args], log_path, env)
    try:
        line = read_line_starting(proc, "engine ready:", START_TIMEOUT_S)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        raise RuntimeError(
            f"server did not start:\n{log_path.read_text(errors='replace')}"
        ) from None
    match = READY_RE.match(line)
    assert match, f"unexpected ready line: {line!r}"
    return Server(
        proc=proc,
        url=match["url"],
        model=match["model"],
        admin_socket=Path(match["socket"]),
        log_path=log_path,
        ready_line=line,
    )


def read_line_starting(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first line `proc` prints that starts with `prefix` (others are skipped), within
    `timeout` seconds; an error if it exits or closes stdout first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.5):
                if proc.poll() is not None:
                    raise RuntimeError(f"exited with {proc.returncode} before {prefix!r}")
                continue
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"stdout closed before {prefix!r} (exit {proc.wait(10)})")
            if line.startswith(prefix):
                return line.strip()
    raise TimeoutError(f"no line starting with {prefix!r} within {timeout:g} s")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it first)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
