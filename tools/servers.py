"""Our server and vLLM's OpenAI server as subprocesses on 127.0.0.1, and stopping them cleanly.

Each server leads a session of its own, so stopping it also ends whatever it started (our
actors, vLLM's engine core) and nothing outlives the benchmark. Only processes started here are
ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.harness import free_port, read_line_starting, stop_process

REPO = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 60.0


class ServerFailed(Exception):
    """A server did not come up; the message names it and where its log is."""


@contextlib.contextmanager
def engine_server(
    model: str, logs: Path, extra_args: list[str], start_timeout: float
) -> Iterator[str]:
    """`python -m engine` on a free port; yields its URL once it printed its ready line."""
    cmd = [sys.executable, "-m", "engine", "serve", "--model", model,
           "--host", "127.0.0.1", "--port", "0", *extra_args]  # fmt: skip
    log_path = logs / "engine.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True)  # fmt: skip
    try:
        try:
            line = read_line_starting(proc, "engine ready:", start_timeout)
        except (RuntimeError, TimeoutError) as e:
            raise ServerFailed(f"engine server did not start ({e}); log: {log_path}") from None
        yield line.split()[2]  # "engine ready: URL (model NAME; admin socket PATH)"
    finally:
        stop_server(proc)


@contextlib.contextmanager
def vllm_server(
    python: str, model: str, logs: Path, extra_args: list[str], start_timeout: float
) -> Iterator[str]:
    """vLLM's OpenAI server with PEERS.md's settings; yields its URL once /v1/models answers
    (it prints no ready line of its own)."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server",
           "--model", model, "--dtype", "float32", "--enforce-eager",
           "--gpu-memory-utilization", "0.3", "--host", "127.0.0.1", "--port", str(port),
           *extra_args]  # fmt: skip
    with http_server(cmd, "vLLM server", logs / "vllm.log", "/v1/models", start_timeout) as url:
        yield url


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
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while not _answers(url + ready_route):
            if proc.poll() is not None:
                raise ServerFailed(f"{name} exited with {proc.returncode} before it was ready; "
                                   f"log: {log_path}")  # fmt: skip
            if time.monotonic() > deadline:
                raise ServerFailed(f"{name} not ready within {start_timeout:g} s; "
                                   f"log: {log_path}")  # fmt: skip
            time.sleep(0.5)
        yield url
    finally:
        stop_server(proc, stop_timeout)


def served_model(url: str) -> str:
    """The name the server answers to (ours: from the checkpoint; vLLM's: the path)."""
    reply = httpx.get(url + "/v1/models", timeout=30.0)
    reply.raise_for_status()
    return str(reply.json()["data"][0]["id"])


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=5.0).status_code == 200
    return False


def stop_server(
    proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT_S
) -> None:
    """SIGTERM, wait, SIGKILL; then anything still in the server's session gets the same time
    to go and is killed after."""
    stop_process(proc, timeout)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout
    while _session_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the server led its session: pgid == its pid


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
