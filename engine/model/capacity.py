"""How many KV cache blocks fit in a memory budget (pure arithmetic, no torch import)."""

from __future__ import annotations

from typing import Any

from engine.model.config import ModelConfig
from engine.model.parallel.layout import kv_heads_per_rank

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype given as a torch.dtype or its name ("bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def kv_block_bytes(
    config: ModelConfig, block_size: int, dtype: Any, tensor_parallel_size: int = 1
) -> int:
    """Bytes one block of `block_size` tokens takes across all layers (K and V) on one rank: a
    tensor-parallel rank holds only its KV heads (replicated ones included)."""
    kv_heads = kv_heads_per_rank(config, tensor_parallel_size)
    per_token = 2 * kv_heads * config.head_dim
    return config.num_layers * block_size * per_token * dtype_bytes(dtype)


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


def available_cpu_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")
