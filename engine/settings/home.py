"""Where the engine keeps its own files (the demo model, the CPU kernel's build, what it derives
from GGUF files) when no setting names the place: $ENGINE_HOME, else ~/.cache/engine
(runtime.engine_home's default), and how a directory of them is built."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


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
