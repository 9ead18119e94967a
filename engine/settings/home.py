"""Where the engine keeps its own files (the demo model, the CPU kernel's build, what it derives
from GGUF files) when no setting names the place: $ENGINE_HOME, else ~/.cache/engine
(runtime.engine_home's default), how a directory of them is built, and the check that nobody
else can change what the engine loads from there (the CPU kernel's library, the demo model)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from engine.runtime.private_files import ForeignFileError, check_owned_tree, owner_of


def default_engine_home() -> Path:
    return Path(os.environ.get("ENGINE_HOME") or "~/.cache/engine").expanduser()


def build_directory(target: Path, build: Callable[[Path], object], marker: str) -> None:
    """Run `build` into a staging directory beside `target`, then rename it into place whole:
    concurrent builders never see half a directory. One that loses the race keeps the winner's
    copy (`marker`, a file every finished build holds, tells that one is there)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build(staging)
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_home_path(path: Path, home: Path) -> None:
    """ForeignFileError unless `home`, every directory from it down to `path`, and `path`
    itself (never a link) belong to this user and are writable by it alone: a library or a
    checkpoint loaded from there is then one this user made."""
    home = home.expanduser()
    check_owned_tree(str(home))
    for directory in reversed(path.relative_to(home).parents[:-1]):
        check_owned_tree(str(home / directory))
    info = os.lstat(path)
    link = stat.S_ISLNK(info.st_mode)
    if link or info.st_uid != os.getuid() or info.st_mode & 0o022:
        mode = stat.S_IMODE(info.st_mode)
        what = "a symbolic link" if link else f"owned by {owner_of(info.st_uid)}, mode {mode:04o}"
        raise ForeignFileError(
            f"refusing {path}: {what}; it must be a file of uid {os.getuid()} that only it can "
            "write"
        )
