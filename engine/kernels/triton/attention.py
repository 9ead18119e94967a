"""The Triton backend's paged_attention: store this step's K/V by slot mapping, then one decode
launch for the one-token chunks and one extend launch for the longer ones."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_cache import PagedKVCache
from engine.kernels.triton.decode_attention import decode_attention
from engine.kernels.triton.extend_attention import extend_attention
from engine.kernels.triton.metadata import TritonAttentionMetadata


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_slot,
    stride_cache_head,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
    cache_offsets = slot * stride_cache_slot + heads * stride_cache_head + dims
    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask)
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask)
    value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask)


def store_kv(
    cache: PagedKVCache,
    layer: int,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Write K/V [tokens, kv_heads, head_dim] (any token and head strides) into their slots."""
    key_cache, value_cache = cache.keys[layer], cache.values[layer]
    if key.shape[0] == 0:
        return
    kv_heads, head_dim = key.shape[1:]
    _store_kv_kernel[(key.shape[0],)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    meta: TritonAttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache and attend. query [tokens, heads, head_dim], key and
    value [tokens, kv_heads, head_dim] (last dimension contiguous); returns
    [tokens, heads * head_dim]. Sliding windows and soft-capping are not written yet: the start
    refuses such a model with this backend (engine/model/architectures/families.py)."""
    if window is not None or softcap is not None:
        raise ValueError("the Triton kernels have no sliding window or soft-capping yet")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in head_dim, got strides {tensor.stride()}"
            )
    store_kv(cache, layer, meta.slot_mapping, key, value)
    out = query.new_empty(meta.num_tokens, query.shape[1] * query.shape[2])
    if meta.decode_chunks.numel():
        decode_attention(query, cache, layer, meta, scale, out)
    if meta.extend_chunks.numel():
        extend_attention(query, cache, layer, meta, scale, out)
    return out
