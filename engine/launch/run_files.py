"""Files a run keeps in /dev/shm only so that restarted actors start fast: the tokenizer a
tokenizer built (engine/actors/tokenizer.py) and the weights a worker built
(engine/model/loading/weight_store.py), both named `engine-<root pid>-<kind>-<digest>`.

Their actors remove them when stopped in order, but an actor killed and not restarted (the
engine gave up) removes nothing, so the root removes what is left when the engine stops. A
crashed root's are swept by the next start, with its rings (engine/runtime/ring.py).
"""

from __future__ import annotations

import contextlib
import os

RUN_FILE_KINDS = ("tokenizer", "weights")


def remove_run_files(root_pid: int, directory: str = "/dev/shm") -> list[str]:
    """Unlink this run's restart files (mappings of them stay valid); the names removed."""
    prefixes = tuple(f"engine-{root_pid}-{kind}-" for kind in RUN_FILE_KINDS)
    removed = []
    for entry in os.listdir(directory):
        if entry.startswith(prefixes):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, entry))
                removed.append(entry)
    return sorted(removed)
