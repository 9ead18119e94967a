"""Whether two kv_transfer actors share a host, and with it /dev/shm (so a puller may map the
server's cache segment instead of reading it over a socket)."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path


@cache
def host_id(shm_dir: str = "/dev/shm") -> str:
    """Equal for two processes of one user on one booted kernel seeing the same /dev/shm mount
    (the boot id alone would also match containers with separate /dev/shm mounts, and another
    user could not open our owner-only segments)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip() if boot.exists() else os.uname().nodename
    shm = os.stat(shm_dir)
    return f"{boot_id}/{os.getuid()}/{shm.st_dev}:{shm.st_ino}"
