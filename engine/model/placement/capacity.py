"""How many KV cache blocks fit in a memory budget (pure arithmetic, no torch import), and how
much memory this process has to give them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model.config import ModelConfig
from engine.model.parallel.layout import kv_heads_per_rank

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
# Bytes after each head row's elements: an int8 row's float32 scale (engine/kernels/kv_cache.py)
ROW_SCALE_BYTES = {"int8": 4}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype given as a torch.dtype or its name ("bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def kv_head_row_bytes(head_dim: int, dtype: Any) -> int:
    """Bytes one KV head's K (or V) of one token takes in a cache of `dtype`."""
    name = str(dtype).removeprefix("torch.")
    return head_dim * dtype_bytes(name) + ROW_SCALE_BYTES.get(name, 0)


def kv_block_bytes(
    config: ModelConfig, block_size: int, dtype: Any, tensor_parallel_size: int = 1
) -> int:
    """Bytes one block of `block_size` tokens takes across all layers (K and V) on one rank, in
    a cache of `dtype`: a tensor-parallel rank holds only its KV heads (replicated ones
    included)."""
    kv_heads = kv_heads_per_rank(config, tensor_parallel_size)
    per_token = 2 * kv_heads * kv_head_row_bytes(config.head_dim, dtype)
    return config.num_layers * block_size * per_token


def kv_cache_blocks(
    config: ModelConfig,
    memory_bytes: int,
    block_size: int,
    dtype: Any,
    tensor_parallel_size: int = 1,
) -> int:
    """Whole blocks that fit in `memory_bytes` (of one rank)."""
    if block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size}")
    if memory_bytes < 0:
        raise ValueError(f"KV cache memory must be >= 0 bytes, got {memory_bytes}")
    return memory_bytes // kv_block_bytes(config, block_size, dtype, tensor_parallel_size)


def available_cpu_memory(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes this process can still take: MemAvailable from /proc/meminfo, or less where its
    cgroup leaves less. In a container the host's free memory is not this process's to take:
    past its memory limit the kernel kills it (Kubernetes' OOMKilled), so the KV cache is sized
    from what the limit leaves."""
    host = _meminfo_available(proc / "meminfo")
    room = cgroup_memory_room(proc / "self" / "cgroup", cgroups)
    return host if room is None else min(host, room)


def _meminfo_available(meminfo_path: Path) -> int:
    with open(meminfo_path) as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo_path} has no MemAvailable line")


# cgroup v1 reports "no limit" as the largest page-aligned int64; anything this large is none.
_NO_LIMIT = 1 << 60


def cgroup_memory_room(membership: Path, cgroups: Path) -> int | None:
    """The smallest room left under a memory limit of this process's cgroup or one above it
    (limit - usage, usage not counting the page cache the kernel can drop: its inactive file
    pages, as `docker stats` counts it); None where no limit is set or none can be read.
    `membership`: /proc/self/cgroup; `cgroups`: where the hierarchies are mounted. Both cgroup
    v2 (memory.max, memory.current) and v1 (memory/memory.limit_in_bytes, usage_in_bytes)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        fields = line.split(":", 2)  # hierarchy-id:controllers:path
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: one unified hierarchy
            names = ("memory.max", "memory.current", "inactive_file")
            rooms += _rooms_up(cgroups, cgroups / path.lstrip("/"), names)
        elif "memory" in controllers.split(","):
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            rooms += _rooms_up(cgroups / "memory", cgroups / "memory" / path.lstrip("/"), names)
    return min(rooms) if rooms else None


def _rooms_up(root: Path, leaf: Path, names: tuple[str, str, str]) -> list[int]:
    """Room under each limited cgroup from `leaf` up to the hierarchy's `root` (a container
    sees its own cgroup as the root, and the path in /proc/self/cgroup may not exist in it)."""
    limit_name, usage_name, inactive_name = names
    rooms = []
    directory = leaf
    while True:
        try:
            limit_text = (directory / limit_name).read_text().strip()
            limit = _NO_LIMIT if limit_text == "max" else int(limit_text)
            if limit < _NO_LIMIT:
                usage = int((directory / usage_name).read_text())
                rooms.append(
                    max(0, limit - usage + _stat(directory / "memory.stat", inactive_name))
                )
        except (OSError, ValueError):
            pass
        if directory == root or root not in directory.parents:
            return rooms
        directory = directory.parent


def _stat(path: Path, key: str) -> int:
    """One counter of a memory.stat file (0 when absent)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
