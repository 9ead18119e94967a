"""Paged decode attention, split-K (flash-decoding): one query token per sequence.

A sequence's context is cut into NUM_SPLITS ranges, each handled by its own program, so a
few long sequences still fill the GPU. Each program takes one KV head and all the query heads
that share it (GQA: one K/V tile load serves the whole group, nothing is copied per query
head), walks its range through the block table, and leaves a partial output with its
log-sum-exp; a second kernel combines the splits, weighting each by its share of the softmax.
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
TOKENS_PER_SPLIT = 256  # a context gets one split per this many tokens ...
MAX_SPLITS = 16  # ... up to this many (a power of two: the reduction's tile)


@triton.jit
def _decode_split_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_starts_ptr,
    context_lens_ptr,
    decode_chunks_ptr,
    partial_out_ptr,  # [decodes, heads, NUM_SPLITS, HEAD_DIM] float32
    partial_lse_ptr,  # [decodes, heads, NUM_SPLITS] float32
    scale,
    stride_query_token,
    stride_query_head,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # GROUP padded to a tile dot() accepts
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FLOAT32_MATMUL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    chunk = tl.load(decode_chunks_ptr + seq)
    row = tl.load(query_starts_ptr + chunk)
    context = tl.load(context_lens_ptr + chunk)
    split_len = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, context)

    group_offsets = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + group_offsets
    head_valid = group_offsets < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    query = tl.load(
        query_ptr + row * stride_query_token + heads[:, None] * stride_query_head + dims[None, :],
        mask=head_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    table_row = block_tables_ptr + chunk * stride_table
    head_offset = kv_head * stride_cache_head
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    row_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    for tile_start in range(split_start, split_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = positions < split_end
        slots = key_slots(table_row, positions, valid, BLOCK_SIZE)
        keys = load_tile(
            key_cache_ptr, slots, valid, head_offset, stride_cache_slot, dims, dim_valid
        )
        scores = matmul(query, tl.trans(keys), FLOAT32_MATMUL) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        values = load_tile(
            value_cache_ptr, slots, valid, head_offset, stride_cache_slot, dims, dim_valid
        )
        acc, row_max, row_sum = online_softmax_step(
            acc, row_max, row_sum, scores, values, FLOAT32_MATMUL
        )

    # An empty split (its range starts past the context) leaves lse = -inf: weight 0 below.
    has_keys = row_sum > 0
    row_sum = tl.where(has_keys, row_sum, 1.0)
    lse = tl.where(has_keys, row_max + tl.log(row_sum), float("-inf"))
    out = acc / row_sum[:, None]
    partial = (seq * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
    tl.store(partial_lse_ptr + partial, lse, mask=head_valid)
    tl.store(
        partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :],
        out,
        mask=head_valid[:, None] & dim_valid[None, :],
    )


@triton.jit
def _combine_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    query_starts_ptr,
    decode_chunks_ptr,
    out_ptr,
    stride_out_token,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    partial = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    lse = tl.load(partial_lse_ptr + partial + splits)
    weights = tl.exp(lse - tl.max(lse, 0))  # split 0 always has keys: the max is finite
    outs = tl.load(
        partial_out_ptr + (partial + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(outs * weights[:, None], 0) / tl.sum(weights, 0)
    row = tl.load(query_starts_ptr + tl.load(decode_chunks_ptr + seq))
    tl.store(
        out_ptr + row * stride_out_token + head * HEAD_DIM + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


def num_splits(max_context: int) -> int:
    """K splits per sequence: a power of two, so each count compiles one kernel variant."""
    wanted = min(MAX_SPLITS, -(-max_context // TOKENS_PER_SPLIT))
    return int(triton.next_power_of_2(max(1, wanted)))


def decode_attention(
    query: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    meta: TritonAttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention of the decode chunks' query rows [tokens, heads, head_dim] over their cached
    context, written into their rows of out [tokens, heads * head_dim]."""
    decodes = meta.decode_chunks.numel()
    heads, head_dim = query.shape[1:]
    key_cache, value_cache = cache.keys[layer], cache.values[layer]
    kv_heads = key_cache.shape[1]
    group = heads // kv_heads
    splits = num_splits(meta.max_decode_context)
    partial_out = torch.empty(
        decodes, heads, splits, head_dim, dtype=torch.float32, device=query.device
    )
    partial_lse = torch.empty(decodes, heads, splits, dtype=torch.float32, device=query.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(decodes, kv_heads, splits)](
        query,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.query_starts,
        meta.context_lens,
        meta.decode_chunks,
        partial_out,
        partial_lse,
        scale,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        meta.block_tables.stride(0),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=cache.block_size,
        BLOCK_N=BLOCK_N,
        NUM_SPLITS=splits,
        FLOAT32_MATMUL=FLOAT32_MATMUL,
    )
    _combine_splits_kernel[(decodes, heads)](
        partial_out,
        partial_lse,
        meta.query_starts,
        meta.decode_chunks,
        out,
        out.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
    )
