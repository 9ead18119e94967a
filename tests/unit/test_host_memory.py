"""glibc malloc tuning for CPU model processes: large temporaries come from the heap, and freed
memory stays there for the next step instead of going back to the kernel (page faults and
zeroing on every step otherwise)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import ctypes
from engine.model.placement.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 20 << 20
if {tune}:
    assert keep_freed_memory()
mmapped_before = libc.mallinfo2().hblkhd
block = libc.malloc(SIZE)
from_mmap = libc.mallinfo2().hblkhd - mmapped_before >= SIZE
libc.free(block)
kept = libc.mallinfo2().fordblks >= SIZE
print(from_mmap, kept)
"""


def run(tune: bool) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tune=tune)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_large_block_comes_from_the_heap_and_stays_after_free() -> None:
    if run(tune=False) != "True False":
        pytest.skip("this C library does not behave as glibc's defaults do (not glibc?)")
    assert run(tune=True) == "False True"
