"""Where admin sockets live, and how a client finds a running server's.

Each server gets an owner-only directory `<base>/<pid>/` holding `admin.sock` (mode 0600), where
`<base>` is `$XDG_RUNTIME_DIR/engine` when that directory is usable, else `/tmp/engine-<uid>`
(mode 0700, which must be ours). A client without `--socket` takes the newest socket in `<base>`
whose server process is still alive; directories of dead servers are swept at the next start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from engine.runtime.private_files import ensure_private_dir
from engine.runtime.shm import pid_alive

SOCKET_NAME = "admin.sock"


def runtime_base(environ: Mapping[str, str]) -> Path:
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg) / "engine"
    return Path(tempfile.gettempdir()) / f"engine-{os.getuid()}"


def prepare_default_socket(environ: Mapping[str, str], pid: int) -> Path:
    """Sweep dead servers' directories, create `<base>/<pid>/` (both 0700), return the socket."""
    base = runtime_base(environ)
    ensure_private_dir(str(base))
    sweep_stale(base)
    run_dir = base / str(pid)
    ensure_private_dir(str(run_dir))
    return run_dir / SOCKET_NAME


def sweep_stale(base: Path) -> list[Path]:
    """Remove `<base>/<pid>/` directories whose server is gone; return what was removed."""
    removed: list[Path] = []
    if not base.is_dir():
        return removed
    for child in base.iterdir():
        if child.name.isdigit() and not pid_alive(int(child.name)):
            with contextlib.suppress(OSError):
                shutil.rmtree(child)
                removed.append(child)
    return removed


def live_sockets(base: Path) -> list[Path]:
    """Sockets of running servers under `base`, newest first."""
    found = []
    if base.is_dir():
        for child in base.iterdir():
            sock = child / SOCKET_NAME
            if child.name.isdigit() and pid_alive(int(child.name)) and sock.exists():
                found.append(sock)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
