"""Files a run keeps in /dev/shm only so that restarted actors start fast: the tokenizer a
tokenizer built (engine/actors/tokenizer.py) and the weights a worker built
(engine/model/loading/weight_store.py), both named `<kind>-<digest>` in the root's run directory
(engine/runtime/shm.py).

Their actors remove them when stopped in order, but an actor killed and not restarted (the
engine gave up) removes nothing, so the root removes what is left when the engine stops, and
then the run directory if nothing else is in it. A crashed root's are swept by the next start,
with its rings (engine/runtime/ring.py).
"""

from __future__ import annotations

import contextlib
import os

from engine.runtime.shm import SHM_DIR, current_run_directory, release_run_directory

RUN_FILE_KINDS = ("tokenizer", "weights")


def remove_run_files(directory: str = SHM_DIR) -> list[str]:
    """Unlink this process's run's restart files (mappings of them stay valid); their names."""
    run_dir = current_run_directory()
    if not run_dir:
        return []
    prefixes = tuple(f"{kind}-" for kind in RUN_FILE_KINDS)
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(os.path.join(directory, run_dir)):
            if entry.startswith(prefixes):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, run_dir, entry))
                    removed.append(entry)
    release_run_directory()
    return sorted(removed)
