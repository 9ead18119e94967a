"""The shared-memory segments and doorbells of runs rooted in one process: the files in its run
directories in /dev/shm (engine/runtime/shm.py), loose segments of older runs, and its doorbells
(named after the run directory, flattened). Empty run directories are not counted: a process's
own is made on first use and kept while it runs."""

from __future__ import annotations

import os
from pathlib import Path

from engine.runtime.doorbell import default_doorbell_dir
from engine.runtime.shm import SHM_DIR


def ipc_files(pid: int | None = None) -> set[Path]:
    prefix = f"engine-{os.getpid() if pid is None else pid}-"
    found: set[Path] = set()
    for directory in (Path(SHM_DIR), Path(default_doorbell_dir())):
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            if not path.name.startswith(prefix):
                continue
            if path.is_dir() and not path.is_symlink():
                found.update(path.iterdir())
            else:
                found.add(path)
    return found
