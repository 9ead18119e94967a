"""Prefill/extend attention: chunks of several tokens, causal, over their cached context.

This step's K/V are already in the cache (store_kv runs first), so a chunk's keys, old and
new, are all read through its block table: position p of the chunk's sequence attends to keys
0..p. A program takes BLOCK_Q consecutive query tokens of one chunk and every query head of one
KV head, folded into one tile of BLOCK_Q * GROUP_PAD rows (GQA without copying K/V per query
head), and stops at the keys its last query may see.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_cache import PagedKVCache
from engine.kernels.triton.metadata import TritonAttentionMetadata
from engine.kernels.triton.paged_tiles import (
    FLOAT32_MATMUL,
    key_slots,
    load_tile,
    matmul,
    online_softmax_step,
)

BLOCK_N = 32  # keys per tile
ROWS_PER_TILE = 64  # query rows (tokens x heads of a group) per program


@triton.jit
def _extend_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_starts_ptr,
    context_lens_ptr,
    extend_chunks_ptr,
    out_ptr,
    scale,
    stride_query_token,
    stride_query_head,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    stride_out_token,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,
    FLOAT32_MATMUL: tl.constexpr,
):
    chunk = tl.load(extend_chunks_ptr + tl.program_id(0))
    kv_head = tl.program_id(1)
    first_token = tl.program_id(2) * BLOCK_Q
    first_row = tl.load(query_starts_ptr + chunk)
    query_len = tl.load(query_starts_ptr + chunk + 1) - first_row
    if first_token < query_len:  # the grid is sized for the longest chunk
        context = tl.load(context_lens_ptr + chunk)
        chunk_start = context - query_len  # position of the chunk's first token

        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        tokens = first_token + rows // GROUP_PAD
        in_group = rows % GROUP_PAD
        heads = kv_head * GROUP + in_group
        row_valid = (tokens < query_len) & (in_group < GROUP)
        query_positions = chunk_start + tokens
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM
        query = tl.load(
            query_ptr
            + (first_row + tokens)[:, None] * stride_query_token
            + heads[:, None] * stride_query_head
            + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        table_row = block_tables_ptr + chunk * stride_table
        head_offset = kv_head * stride_cache_head
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], dtype=tl.float32)
        row_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
        # Keys past the tile's last query are masked for every row: stop before them.
        keys_end = tl.minimum(context, chunk_start + first_token + BLOCK_Q)
        for tile_start in range(0, keys_end, BLOCK_N):
            positions = tile_start + tl.arange(0, BLOCK_N)
            valid = positions < keys_end
            slots = key_slots(table_row, positions, valid, BLOCK_SIZE)
            keys = load_tile(
                key_cache_ptr, slots, valid, head_offset, stride_cache_slot, dims, dim_valid
            )
            scores = matmul(query, tl.trans(keys), FLOAT32_MATMUL) * scale
            # Every row sees key 0 in the first tile, so its running max is finite from then on.
            visible = valid[None, :] & (positions[None, :] <= query_positions[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            values = load_tile(
                value_cache_ptr, slots, valid, head_offset, stride_cache_slot, dims, dim_valid
            )
            acc, row_max, row_sum = online_softmax_step(
                acc, row_max, row_sum, scores, values, FLOAT32_MATMUL
            )

        out = acc / row_sum[:, None]
        tl.store(
            out_ptr
            + (first_row + tokens)[:, None] * stride_out_token
            + heads[:, None] * HEAD_DIM
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


def extend_attention(
    query: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    meta: TritonAttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention of the extend chunks' query rows [tokens, heads, head_dim] over their
    context (cached keys and their own), written into their rows of out."""
    heads, head_dim = query.shape[1:]
    key_cache, value_cache = cache.keys[layer], cache.values[layer]
    kv_heads = key_cache.shape[1]
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, ROWS_PER_TILE // group_pad)
    grid = (meta.extend_chunks.numel(), kv_heads, triton.cdiv(meta.max_extend_len, block_q))
    _extend_kernel[grid](
        query,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.query_starts,
        meta.context_lens,
        meta.extend_chunks,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        meta.block_tables.stride(0),
        out.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=cache.block_size,
        BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        FLOAT32_MATMUL=FLOAT32_MATMUL,
    )
