"""Where the engine keeps its own files (the demo model, the CPU kernel's build) when no setting
names the place: $ENGINE_HOME, else ~/.cache/engine (runtime.engine_home's default)."""

from __future__ import annotations

import os
from pathlib import Path


def default_engine_home() -> Path:
    return Path(os.environ.get("ENGINE_HOME") or "~/.cache/engine").expanduser()
