"""The servers tools/chaos/run.py can start itself (--launch), each stopped on leaving.

- single: one `python -m engine` instance.
- pd:     a `--kv-role prefill` instance and a `--kv-role decode` instance behind
          `python -m engine proxy`: the workload goes through the proxy, faults hit the actors of
          both instances (kv_transfer ones included).

Every instance gets a restart intensity that the fault rate cannot exhaust and its own admin
socket in the log directory; without --model the engine serves its default model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.client.servers import engine_running

# Restarts allowed per period: a fault every second or two must never escalate to a shutdown.
RESTART_FLAGS = ["--runtime.restart_intensity", "1000", "--runtime.restart_period", "10"]


@dataclass
class Launched:
    url: str  # where the workload goes
    sockets: dict[str, str | None]  # instance -> admin socket
    logs: Path


@contextlib.contextmanager
def _started(command: list[str], log_path: Path, timeout: float) -> Iterator[str]:
    """Yields the URL of the ready line; stops the process (and its session) on leaving."""
    with engine_running(command, log_path, timeout=timeout) as server:
        yield server.url


def _instance_args(model: str | None, socket: Path, extra: list[str]) -> list[str]:
    model_args = ["--model", model] if model else []
    return [
        "serve",
        *model_args,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--admin.socket",
        str(socket),
        *RESTART_FLAGS,
        *extra,
    ]


@contextlib.contextmanager
def launched(
    mode: str,
    model: str | None,
    extra: list[str],
    logs: Path,
    timeout: float,
    proxy_extra: tuple[str, ...] = (),
) -> Iterator[Launched]:
    if mode == "single":
        socket = logs / "admin.sock"
        args = _instance_args(model, socket, extra)
        with _started(args, logs / "engine.log", timeout) as url:
            yield Launched(url, {"engine": str(socket)}, logs)
        return
    sockets = {role: logs / f"{role}.sock" for role in ("prefill", "decode")}
    with contextlib.ExitStack() as stack:
        urls = {
            role: stack.enter_context(
                _started(
                    _instance_args(model, socket, ["--kv-role", role, *extra]),
                    logs / f"{role}.log",
                    timeout,
                )
            )
            for role, socket in sockets.items()
        }
        proxy = ["proxy", "--prefill", urls["prefill"], "--decode", urls["decode"], "--port", "0"]
        proxy += proxy_extra
        url = stack.enter_context(_started(proxy, logs / "proxy.log", timeout))
        yield Launched(url, {role: str(path) for role, path in sockets.items()}, logs)
