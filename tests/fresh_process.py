"""What a fresh interpreter imports: start-up cost checks that the test process, which has
imported everything already, cannot make itself."""

from __future__ import annotations

import json
import subprocess
import sys


def imported_after(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a new Python process has imported after running `code`."""
    script = (
        f"{code}\nimport json, sys\nprint(json.dumps([m for m in {modules!r} if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
