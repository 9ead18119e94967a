"""A KV cache that /dev/shm cannot hold is refused at start, in one line, before any actor runs
(a segment is sparse: without the check the start succeeds and a worker dies of SIGBUS on the
first KV write past the free space)."""

from __future__ import annotations

import subprocess
import sys

from engine.actors.runtime.shm_space import shm_free
from tests.e2e.harness import REPO, leftover_ipc

GIB = 1 << 30


def test_a_kv_cache_larger_than_free_dev_shm_is_a_one_line_refusal(model_args: list[str]) -> None:
    too_big = shm_free() + 4 * GIB  # a P/D rank's KV cache is a segment in /dev/shm
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "engine", *model_args, "--host", "127.0.0.1", "--port", "0",
            "--device", "cpu", "--kv-role", "prefill", "--kv-cache-memory", str(too_big),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1, stderr
    assert "engine ready" not in stdout
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("engine: failed to start: /dev/shm has "), stderr
    assert " free but this run needs " in last and "lower cache.kv_cache_memory" in last, last
    assert "Traceback" not in stderr and "started worker" not in stderr
    assert leftover_ipc(proc.pid) == []
