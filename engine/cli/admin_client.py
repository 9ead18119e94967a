"""`python -m engine admin [--socket PATH] COMMAND [ARGS] [--json]`: talk to a running server.

Without --socket the client takes the newest admin socket of a live server in the runtime
directory (see engine/http/admin/paths.py). Output is a readable table, or the raw JSON reply
with --json. Exit status: 0 done, 1 the server refused the command, 2 usage or connection error.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from engine.http.admin.paths import live_sockets, runtime_base

USAGE = (
    "usage: python -m engine admin [--socket PATH] [--timeout SECONDS] [--json] COMMAND [ARGS]\n"
    "commands: health | stats | actors | requests | abort ID | drain | shutdown | "
    "log-level LEVEL"
)
_SLOW_COMMANDS = {"drain", "shutdown"}  # these wait for in-flight requests


class _Usage(Exception):
    pass


def run_admin(argv: list[str], environ: Mapping[str, str]) -> int:
    try:
        socket_path, timeout, as_json, words = _parse(argv)
        if not words:
            raise _Usage("no command given")
        path = Path(socket_path) if socket_path else _find_socket(environ)
        if timeout is None:
            timeout = 3600.0 if words[0] in _SLOW_COMMANDS else 30.0
        reply = send_command(path, words[0], words[1:], timeout=timeout)
    except _Usage as e:
        if str(e) == "help":
            print(USAGE)
            return 0
        print(f"engine admin: {e}\n{USAGE}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"engine admin: {e}", file=sys.stderr)
        return 2
    if as_json:
        sys.stdout.write(msgspec.json.encode(reply).decode() + "\n")
    elif reply.get("ok"):
        print(render(reply.get("result")))
    else:
        print(f"error: {reply.get('error')}", file=sys.stderr)
    return 0 if reply.get("ok") else 1


def _parse(argv: list[str]) -> tuple[str | None, float | None, bool, list[str]]:
    socket_path: str | None = None
    timeout: float | None = None
    as_json = False
    words: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        name, has_value, value = arg.partition("=")
        if name in ("--socket", "--timeout") and not words:
            if not has_value:
                if i >= len(argv):
                    raise _Usage(f"{name} needs a value")
                value, i = argv[i], i + 1
            if name == "--socket":
                socket_path = value
            else:
                try:
                    timeout = float(value)
                except ValueError:
                    raise _Usage(f"--timeout must be a number of seconds, got {value!r}") from None
        elif arg == "--json":
            as_json = True
        elif arg in ("-h", "--help"):
            raise _Usage("help")
        else:
            words.append(arg)
    return socket_path, timeout, as_json, words


def _find_socket(environ: Mapping[str, str]) -> Path:
    base = runtime_base(environ)
    found = live_sockets(base)
    if not found:
        raise OSError(f"no running engine found under {base}; pass --socket PATH")
    return found[0]


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
