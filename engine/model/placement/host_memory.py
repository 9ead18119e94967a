"""glibc malloc tuning for a process that runs the model on the CPU.

A decode step allocates and frees large temporaries (K and V gathered from the paged cache:
21 MB each per layer at 128 sequences of 320 tokens). By default glibc serves such blocks with
fresh mmaps, or returns the freed top of its heap to the kernel, so every step pays page faults
and zeroing for memory it had a moment ago, which can cost more than the step's arithmetic.
Left to glibc, a process's speed would also depend on what it happened to run first: a large
prefill raises glibc's adaptive mmap threshold, and a run with smaller prefill chunks never gets
that raise.

`keep_freed_memory()` serves blocks up to glibc's largest mmap threshold from the heap and trims
the heap only past 2 GiB of free top: the process keeps its peak working set, as a serving worker
does anyway.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # the largest value glibc accepts on 64-bit
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top is kept


def keep_freed_memory() -> bool:
    """Tune this process's malloc (glibc only); False where there is nothing to tune."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave it as it is
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    tuned = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    tuned = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and tuned
    if not tuned:
        log.warning("mallopt refused the settings; large CPU steps may pay page faults")
    return bool(tuned)


def release_freed_memory() -> bool:
    """Give the memory freed so far back to the kernel (glibc's malloc_trim), once, after the
    weights are loaded: what the load freed (a quantized weight's one-byte-per-value codes, a
    GGUF tensor's dequantized rows) would otherwise stay resident under keep_freed_memory's
    settings for the life of the worker. False where there is no malloc_trim."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    return bool(malloc_trim(0))
