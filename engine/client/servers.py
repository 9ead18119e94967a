"""Servers started from outside: the engine's (`serve` or `proxy`, ready once it prints its ready
line) and a peer's (llama-server, vLLM: ready once a route answers), each stopped on leaving."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engine.client.process import (
    STOP_TIMEOUT_S,
    read_line_starting,
    spawn_engine,
    stop_process,
    stop_session,
)

READY_PREFIX = "engine ready:"
# `engine serve`: "engine ready: URL (model NAME; admin socket PATH)"; `engine proxy`:
# "engine ready: URL (proxy; ROLES)".
READY_RE = re.compile(
    r"^engine ready: (?P<url>(?:http://|unix:)\S+) \(model (?P<model>[^;]+); "
    r"admin socket (?P<socket>.+)\)$"
)
START_TIMEOUT_S = 180.0


class ServerFailed(Exception):
    """A server did not come up; the message names it and where its log is."""


@dataclass
class EngineServer:
    """A started `python -m engine serve` (or `proxy`: no model, no admin socket)."""

    proc: subprocess.Popen[str]
    url: str
    ready_line: str
    log_path: Path
    model: str | None = None
    admin_socket: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def http(self, api_key: str | None = None, **kw: Any) -> httpx.Client:
        """A client for its HTTP API (with `api_key` as the bearer token, where given)."""
        kw.setdefault("timeout", 60.0)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_engine(
    command: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    *,
    cwd: Path | None = None,
    own_session: bool = False,
    timeout: float = START_TIMEOUT_S,
) -> EngineServer:
    """`python -m engine <command>` started and its ready line read; ServerFailed (naming the
    log) if it exits or stays silent for `timeout` seconds first, and then it is stopped."""
    proc = spawn_engine(command, log_path, env, cwd=cwd, own_session=own_session)
    try:
        line = read_line_starting(proc, READY_PREFIX, timeout)
    except (RuntimeError, TimeoutError) as e:
        (stop_session if own_session else stop_process)(proc, 10.0)
        raise ServerFailed(f"engine {command[0]} did not start ({e}); log: {log_path}") from None
    match = READY_RE.match(line)
    if match is None:  # the proxy's line: only the URL is known
        return EngineServer(proc, line.split()[2], line, log_path)
    socket = Path(match["socket"])
    return EngineServer(proc, match["url"], line, log_path, match["model"], socket)


@contextlib.contextmanager
def engine_running(
    command: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    *,
    cwd: Path | None = None,
    timeout: float = START_TIMEOUT_S,
    stop_timeout: float = STOP_TIMEOUT_S,
) -> Iterator[EngineServer]:
    """start_engine() in a session of its own, stopped with everything it started on leaving,
    whatever happened."""
    server = start_engine(command, log_path, env, cwd=cwd, own_session=True, timeout=timeout)
    try:
        yield server
    finally:
        stop_session(server.proc, stop_timeout)


@contextlib.contextmanager
def engine_server(
    model: str | None, logs: Path, extra_args: list[str], start_timeout: float
) -> Iterator[str]:
    """`engine serve --model MODEL` (None: the default model) on a free port of 127.0.0.1 (its
    log: `logs`/engine.log); yields its URL once ready, and stops it with everything it started
    on leaving."""
    model_args = [] if model is None else ["--model", model]
    args = ["serve", *model_args, "--host", "127.0.0.1", "--port", "0", *extra_args]
    with engine_running(args, logs / "engine.log", timeout=start_timeout) as server:
        yield server.url


@contextlib.contextmanager
def http_server(
    cmd: list[str],
    name: str,
    log_path: Path,
    ready_route: str,
    start_timeout: float,
    env: dict[str, str] | None = None,
    stop_timeout: float = STOP_TIMEOUT_S,
) -> Iterator[str]:
    """A peer's server started on the port `cmd` names (`--port N`), in a session of its own;
    yields its URL once `ready_route` answers 200 (peers print no ready line we can rely on)."""
    port = cmd[cmd.index("--port") + 1]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while not _answers(url + ready_route):
            if proc.poll() is not None:
                raise ServerFailed(
                    f"{name} exited with {proc.returncode} before it was ready; log: {log_path}"
                )
            if time.monotonic() > deadline:
                raise ServerFailed(f"{name} not ready within {start_timeout:g} s; log: {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        stop_session(proc, stop_timeout)


def served_model(url: str) -> str:
    """The name the server answers to (ours: from the checkpoint; vLLM's: the path)."""
    reply = httpx.get(url + "/v1/models", timeout=30.0)
    reply.raise_for_status()
    return str(reply.json()["data"][0]["id"])


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=5.0).status_code == 200
    return False
