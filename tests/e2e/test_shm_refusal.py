"""A KV cache that /dev/shm cannot hold is refused at start, in one line, before any actor runs
(a segment is sparse: without the check the start succeeds and a worker dies of SIGBUS on the
first KV write past the free space)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from engine.runtime.shm_space import shm_free
from tests.e2e.harness import REPO, free_port, leftover_ipc

GIB = 1 << 30


def test_a_kv_cache_larger_than_free_dev_shm_is_a_one_line_refusal(model_args: list[str]) -> None:
    too_big = shm_free() + 4 * GIB  # a CPU rank's KV cache is a segment in /dev/shm
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            *model_args,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--device",
            "cpu",
            "--kv-cache-memory",
            str(too_big),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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


def _can_mount_own_dev_shm() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_own_dev_shm(), reason="needs unprivileged user namespaces")
def test_a_worker_node_is_refused_in_one_line_when_dev_shm_cannot_hold_its_run(
    model_args: list[str],
) -> None:
    """Node k > 0 of a multi-host launch checks /dev/shm as a single-host start does. It runs in
    a user and mount namespace of its own (util-linux unshare) whose /dev/shm is a 64 KiB tmpfs:
    less than one rank's control rings."""
    node = [
        sys.executable,
        "-m",
        "engine",
        *model_args,
        "--device",
        "cpu",
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]
    small_shm = 'mount -t tmpfs -o size=64k tmpfs /dev/shm && exec "$@"'
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", small_shm, "sh", *node],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("engine: worker node did not start: /dev/shm has "), done.stderr
    assert " free but this run needs " in last and "enlarge /dev/shm" in last, last
    assert "Traceback" not in done.stderr and "started worker" not in done.stderr
