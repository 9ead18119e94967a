"""The admin socket: newline-delimited JSON commands on an owner-only Unix socket.

Request: `{"cmd": "stats", "args": []}`. Reply: `{"ok": true, "result": ...}` or
`{"ok": false, "error": "..."}`, each with `"server"`: the pid, URL and model of the server that
answered. Commands: engine/http/admin/commands.py. Lines are decoded with a typed msgspec decoder,
never unpickled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from engine.http.admin.commands import command_problem
from engine.http.admin.models import (
    AdminError,
    every_models_rows,
    manage_models,
    model_stats,
)
from engine.http.openai.operations import abort_request
from engine.http.served import pool_health
from engine.http.state import ServerState
from engine.settings.fields import FIELDS
from engine.tenants.directory import tenant_rows

log = logging.getLogger("engine.http.admin")

MAX_LINE = 64 * 1024
LOG_LEVELS = FIELDS["runtime.log_level"].choices


class AdminCommand(msgspec.Struct, forbid_unknown_fields=True):
    cmd: str
    args: list[str] = msgspec.field(default_factory=list)


class AdminReply(msgspec.Struct, omit_defaults=True):
    ok: bool
    result: Any = None
    error: str | None = None
    server: dict[str, Any] | None = None  # which server answered: pid, url, model


_DECODER = msgspec.json.Decoder(AdminCommand)


def _encode(reply: AdminReply) -> bytes:
    return msgspec.json.encode(reply, enc_hook=str) + b"\n"


class AdminServer:
    def __init__(
        self,
        state: ServerState,
        path: Path,
        *,
        drain: Callable[[], Awaitable[dict[str, Any]]],
        shutdown: Callable[[], None],
        identity: dict[str, Any] | None = None,
    ) -> None:
        self.state = state
        self.path = path
        self.identity = identity  # named in every reply
        self._drain = drain
        self._shutdown = shutdown
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a leftover from a crashed run (the directory is ours)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others connect
        try:
            self._server = await asyncio.start_unix_server(
                self._serve_client, path=str(self.path), limit=MAX_LINE
            )
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    writer.write(_encode(AdminReply(ok=False, error=f"line over {MAX_LINE} bytes")))
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                reply = await self.handle_line(line)
                reply.server = self.identity
                writer.write(_encode(reply))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def handle_line(self, line: bytes) -> AdminReply:
        try:
            command = _DECODER.decode(line)
        except msgspec.DecodeError as e:
            return AdminReply(
                ok=False, error=f'bad command line ({e}); send {{"cmd": ..., "args": [...]}}'
            )
        try:
            return AdminReply(ok=True, result=await self.run(command.cmd, command.args))
        except AdminError as e:
            return AdminReply(ok=False, error=str(e))
        except Exception as e:
            log.exception("admin command %s failed", command.cmd)
            return AdminReply(ok=False, error=f"{command.cmd} failed: {type(e).__name__}: {e}")

    async def run(self, cmd: str, args: list[str]) -> Any:
        problem = command_problem(cmd, args)
        if problem is not None:
            raise AdminError(problem)
        state = self.state
        if cmd == "health":
            return msgspec.structs.replace(pool_health(state.models), draining=state.draining)
        if cmd == "stats":
            return msgspec.structs.replace(model_stats(state), draining=state.draining)
        if cmd in ("actors", "requests"):
            return every_models_rows(state, cmd)
        if cmd in ("models", "load", "unload"):
            return await manage_models(state, cmd, args)
        if cmd == "abort":
            (request_id,) = args
            # An engine request's id, or an API request's X-Request-Id (all of its prompts)
            if not await abort_request(state, request_id):
                raise AdminError(f"no in-flight request {request_id!r} (see the requests command)")
            return {"aborted": request_id}
        if cmd == "tenants":
            return tenant_rows(state.tenants)
        if cmd == "reload-tenants":
            try:
                return {"reloaded": state.tenants.reload()}
            except ValueError as e:  # the file cannot be used: the old tenants stay
                raise AdminError(str(e)) from None
        if cmd == "drain":
            return await self._drain()
        if cmd == "shutdown":
            self._shutdown()
            return {"shutting_down": True}
        return await _set_log_level(state, args[0])  # log-level, the one command left


async def _set_log_level(state: ServerState, level: str) -> dict[str, str]:
    level = level.lower()
    if level not in LOG_LEVELS:
        raise AdminError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    logging.getLogger().setLevel(level.upper())
    logging.getLogger("engine").setLevel(level.upper())
    for _, served in state.models.loaded():  # every loaded model's actors follow
        served.llm.set_log_level(level)
    return {"log_level": level}
