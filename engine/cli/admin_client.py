"""`python -m engine admin [--socket PATH | --pid PID | --port PORT] COMMAND [ARGS] [--json]`:
talk to a running server.

Without a selector the client looks in this user's runtime directory
(engine/http/admin/paths.py): one live server there is the one; several are refused, listed by
pid, URL and model, until --pid, --port or --socket says which. Every reply names the server
that sent it. Output is a readable table, or the raw JSON reply with --json. Exit status: 0 done,
1 the server refused the command, 2 usage or connection error.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from engine.http.admin.commands import COMMANDS, command_problem
from engine.http.admin.paths import SOCKET_NAME, live_sockets, runtime_base

USAGE = (
    "usage: python -m engine admin [--socket PATH | --pid PID | --port PORT] [--timeout SECONDS] "
    "[--json] COMMAND [ARGS]\n"
    f"commands: {' | '.join(' '.join([cmd, *args]) for cmd, args in COMMANDS.items())}"
)
# these wait for in-flight requests, or for a model to load
_SLOW_COMMANDS = {"drain", "shutdown", "load", "unload"}
_VALUED = ("--socket", "--pid", "--port", "--timeout")
_IDENTIFY_TIMEOUT_S = 5.0  # asking each of several servers who it is


class _Usage(Exception):
    pass


@dataclass
class _Args:
    options: dict[str, str]  # --socket / --pid / --port / --timeout → value
    as_json: bool
    words: list[str]


def run_admin(argv: list[str], environ: Mapping[str, str]) -> int:
    try:
        args = _parse(argv)
        if not args.words:
            raise _Usage("no command given")
        problem = command_problem(args.words[0], args.words[1:])
        if problem is not None:
            raise _Usage(problem)
        path = _server_socket(args.options, environ)
        default_timeout = 3600.0 if args.words[0] in _SLOW_COMMANDS else 30.0
        timeout = _number(args.options, "--timeout", float) or default_timeout
        reply = send_command(path, args.words[0], args.words[1:], timeout=timeout)
    except _Usage as e:
        if str(e) == "help":
            print(USAGE)
            return 0
        print(f"engine admin: {e}\n{USAGE}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"engine admin: {e}", file=sys.stderr)
        return 2
    _show(reply, path, args.as_json)
    return 0 if reply.get("ok") else 1


def _show(reply: dict[str, Any], path: Path, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(msgspec.json.encode(reply).decode() + "\n")
        return
    who = reply.get("server")
    server = f"server: {_describe(who) if isinstance(who, dict) else path}"
    if reply.get("ok"):
        print(f"{server}\n{render(reply.get('result'))}")
    else:
        print(f"{server}\nerror: {reply.get('error')}", file=sys.stderr)


def _parse(argv: list[str]) -> _Args:
    options: dict[str, str] = {}
    as_json = False
    words: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        name, has_value, value = arg.partition("=")
        if name in _VALUED and not words:
            if not has_value:
                if i >= len(argv):
                    raise _Usage(f"{name} needs a value")
                value, i = argv[i], i + 1
            options[name] = value
        elif arg == "--json":
            as_json = True
        elif arg in ("-h", "--help"):
            raise _Usage("help")
        else:
            words.append(arg)
    chosen = [name for name in ("--socket", "--pid", "--port") if name in options]
    if len(chosen) > 1:
        raise _Usage(f"{' and '.join(chosen)} both name a server: give one")
    return _Args(options, as_json, words)


def _number(options: dict[str, str], name: str, kind: type[float] | type[int]) -> Any:
    if name not in options:
        return None
    try:
        value = kind(options[name])
    except ValueError:
        value = -1
    if value <= 0:
        raise _Usage(f"{name} must be a number > 0, got {options[name]!r}")
    return value


def _server_socket(options: dict[str, str], environ: Mapping[str, str]) -> Path:
    """The socket of the server the options name, or of this user's only running server."""
    if "--socket" in options:
        return Path(options["--socket"])
    base = runtime_base(environ)
    pid, port = _number(options, "--pid", int), _number(options, "--port", int)
    if pid is not None and (base / str(pid) / SOCKET_NAME).exists():
        return base / str(pid) / SOCKET_NAME
    servers = [(path, _identity(path)) for path in live_sockets(base)]
    if port is not None:
        serving = [path for path, who in servers if who and _port_of(who.get("url")) == port]
        if serving:
            return serving[0]
    if not servers:
        raise OSError(f"no running engine found under {base}; pass --socket PATH")
    listing = "; ".join(
        _describe(who) if who else f"pid {path.parent.name} (not answering)"
        for path, who in servers
    )
    if pid is not None or port is not None:
        which = f"pid {pid}" if pid is not None else f"port {port}"
        raise OSError(f"no running engine of yours has {which}; running: {listing}")
    if len(servers) > 1:
        raise OSError(
            f"{len(servers)} engines are running: {listing}; say which with --pid, --port or "
            "--socket"
        )
    return servers[0][0]


def _identity(path: Path) -> dict[str, Any] | None:
    """The pid, URL and model a server's admin socket answers with (None: no answer)."""
    try:
        server = send_command(path, "health", [], timeout=_IDENTIFY_TIMEOUT_S).get("server")
    except (OSError, ValueError):
        return None
    return server if isinstance(server, dict) else None


def _describe(server: dict[str, Any]) -> str:
    return f"pid {server.get('pid')} at {server.get('url')} ({server.get('model')})"


def _port_of(url: Any) -> int | None:
    try:
        return urlsplit(str(url)).port
    except ValueError:
        return None


def send_command(path: Path, cmd: str, args: list[str], *, timeout: float) -> dict[str, Any]:
    """Send one command and return the decoded reply."""
    line = msgspec.json.encode({"cmd": cmd, "args": args}) + b"\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        try:
            conn.connect(str(path))
        except OSError as e:
            raise OSError(f"cannot connect to admin socket {path}: {e.strerror or e}") from None
        conn.sendall(line)
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    if not data:
        raise OSError(f"admin socket {path} closed without a reply")
    reply = msgspec.json.decode(data)
    if not isinstance(reply, dict):
        raise ValueError(f"unexpected reply from {path}: {data[:200]!r}")
    return reply


def render(result: Any) -> str:
    """A dict as aligned key/value lines, a list of dicts as a table."""
    if isinstance(result, list):
        if not result:
            return "(none)"
        if all(isinstance(row, dict) for row in result):
            return _table(result)
        return "\n".join(str(item) for item in result)
    if isinstance(result, dict):
        flat = _flatten(result)
        if not flat:
            return "(empty)"
        width = max(len(k) for k in flat)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in flat.items())
    return str(result)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = _cell(value)
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | dict):
        return msgspec.json.encode(value).decode()
    return str(value)


def _table(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    cells = [[c.upper() for c in columns]]
    cells += [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )
