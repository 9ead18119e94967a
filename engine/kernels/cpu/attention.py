"""The compiled CPU backend's paged_attention: decode tokens and short chunks go to the C++
kernel (paged_attention.cpp), which reads each token's context through its block table where it
lies in the cache, in whatever dtype the cache has (kv_rows.h); the step's K/V go into the cache
through kv_store.cpp, which rounds or quantizes them as the fused decode step does; long prefill
chunks take the torch backend's SDPA path (their many queries
amortise one gather of the context, and SDPA's matmuls beat a per-token loop there)."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import torch_attention
from engine.kernels.attention_metadata import AttentionMetadata, ChunkPrefill, TableRows
from engine.kernels.cpu.build import load_library
from engine.kernels.kv_cache import PagedKVCache

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CACHE_DTYPE_CODES = {**DTYPE_CODES, torch.int8: 3}  # kv_rows.h's CacheDtype
# A piece that reads at least this many keys runs on every core given to the rank, even in a step
# whose matmuls run on fewer (placement.ThreadPolicy): a second core adds bandwidth and
# arithmetic, and the kernel's pool never waits for a helper whose core is taken; within a step a
# helper is at hand (thread_pool.h watches for the next call before sleeping). Equal to the part
# size the kernel splits a context into (kPartKeys in paged_attention.cpp), so that from here
# even one decode token has work for two cores.
PARALLEL_KEYS = 256


class _Threads:
    most = 0  # the cores given to this rank; 0: torch's thread count


def set_max_threads(threads: int) -> None:
    """The threads a large piece may use: the cores given to this rank (set by the runner)."""
    _Threads.most = threads


def most_threads() -> int:
    """Every core given to this rank (at least torch's thread count)."""
    return max(_Threads.most, torch.get_num_threads())


def kernel_threads(piece: TableRows) -> int:
    if piece.keys < PARALLEL_KEYS:
        return 1
    return most_threads()


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """As torch_attention.paged_attention, for metadata built with in_place="table"."""
    store_kv(cache, layer, meta.slot_mapping, key, value)
    num_tokens, heads, head_dim = query.shape
    out = query.new_empty(num_tokens, heads * head_dim)
    variant = torch_attention.Variant(window, softcap)
    for piece in meta.pieces:
        if isinstance(piece, TableRows):
            attend_in_place(query, cache, layer, piece, scale, out, variant)
        elif isinstance(piece, ChunkPrefill):
            start, stop = piece.rows
            out[start:stop] = torch_attention.chunk_prefill(
                query, key, value, cache, layer, piece, scale, variant
            )
        else:
            raise TypeError(f"the CPU kernel backend got a {type(piece).__name__} piece")
    return out


def store_kv(
    cache: PagedKVCache,
    layer: int,
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """cache.write by the kernel: the same bytes, in one call instead of torch's several ops."""
    usable = slots.dtype == torch.int64 and slots.is_contiguous() and slots.device.type == "cpu"
    if not (usable and _head_rows(key) and _head_rows(value)):
        cache.write(layer, slots, key, value)
        return
    library = load_library()
    for rows, part in ((key, cache.keys[layer]), (value, cache.values[layer])):
        status = library.engine_kv_store(
            DTYPE_CODES[rows.dtype],
            rows.data_ptr(),
            rows.stride(0),
            rows.shape[0],
            slots.data_ptr(),
            CACHE_DTYPE_CODES[cache.dtype],
            part.data_ptr(),
            cache.num_kv_heads,
            cache.head_dim,
        )
        if status != 0:
            raise RuntimeError(f"the CPU KV cache write failed (status {status})")


def _head_rows(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] of a kernel dtype, each token's heads side by side."""
    return (
        x.dtype in DTYPE_CODES
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and x.device.type == "cpu"
    )


def attend_in_place(
    query: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    piece: TableRows,
    scale: float,
    out: torch.Tensor,
    variant: torch_attention.Variant = torch_attention.PLAIN,
) -> None:
    """Write attention for the piece's tokens into their rows of `out` [step rows, heads *
    head_dim]; query [step rows, heads, head_dim] with each head's row contiguous."""
    _, heads, head_dim = query.shape
    keys, values = cache.keys[layer], cache.values[layer]
    kv_heads = cache.num_kv_heads
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    for name, tensor in (("keys", keys), ("values", values), ("out", out)):
        if not tensor.is_contiguous():
            raise ValueError(f"the CPU attention kernel needs contiguous {name}")
    if query.dtype not in DTYPE_CODES or out.dtype != query.dtype:
        raise ValueError(
            f"the CPU attention kernel takes one dtype of {sorted(map(str, DTYPE_CODES))} for "
            f"query and output, got {query.dtype} and {out.dtype}"
        )
    library = load_library()
    status = library.engine_paged_attention_variant(
        DTYPE_CODES[query.dtype],
        CACHE_DTYPE_CODES[cache.dtype],
        query.data_ptr(),
        query.stride(0),
        keys.data_ptr(),
        values.data_ptr(),
        piece.tables.data_ptr(),
        piece.tables.shape[1],
        piece.token_chunk.data_ptr(),
        piece.seen.data_ptr(),
        None if piece.rows is None else piece.rows.data_ptr(),
        piece.seen.numel(),
        heads,
        kv_heads,
        head_dim,
        cache.block_size,
        ctypes.c_float(scale),
        out.data_ptr(),
        kernel_threads(piece),
        variant.window or 0,
        ctypes.c_float(variant.softcap or 0.0),
    )
    if status != 0:
        raise RuntimeError(f"the CPU attention kernel failed (status {status})")
