"""Device helpers shared by the attention kernels: where a chunk's keys live in the paged cache,
and one step of the online softmax (flash attention's running max and sum)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter (read, like triton.jit does, when the kernels are defined) multiplies
# bfloat16 tiles as if they were integers: there, matmuls run on float32 copies instead.
FLOAT32_MATMUL = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def matmul(a, b, FLOAT32: tl.constexpr):
    """a @ b accumulated in float32; float32 inputs stay exact (no TF32 rounding)."""
    if FLOAT32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def key_slots(table_row_ptr, positions, valid, BLOCK_SIZE: tl.constexpr):
    """Cache slots of the keys at `positions` of one chunk, through its block table row."""
    blocks = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=valid, other=0)
    return blocks.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE


@triton.jit
def load_tile(cache_ptr, slots, valid, head_offset, stride_slot, dims, dim_valid):
    """[keys, head_dim] of one KV head at the given slots; invalid keys read as 0."""
    pointers = cache_ptr + slots[:, None] * stride_slot + head_offset + dims[None, :]
    return tl.load(pointers, mask=valid[:, None] & dim_valid[None, :], other=0.0)


@triton.jit
def online_softmax_step(acc, row_max, row_sum, scores, values, FLOAT32_MATMUL: tl.constexpr):
    """Fold one tile of scores [rows, keys] (masked keys at -inf, at least one finite per row
    so far) and its values [keys, head_dim] into the running accumulator."""
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    probs = tl.exp(scores - new_max[:, None])
    rescale = tl.exp(row_max - new_max)
    row_sum = row_sum * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + matmul(probs.to(values.dtype), values, FLOAT32_MATMUL)
    return acc, new_max, row_sum
