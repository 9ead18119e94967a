"""Paged attention in plain torch: one SDPA call per layer for all decode tokens and one for all
prefill chunks, over K/V gathered by the index tensors of `attention_metadata`.

- decode: chunks of one token, gathered into a padded [seqs, max_context] batch with a mask.
  The query heads that share one KV head are folded into SDPA's query-length axis, so
  grouped-query attention needs no K/V copies.
- prefill: longer chunks, padded to the longest. A chunk starting at `start_pos` attends to all
  cached positions before it and causally to itself, which covers chunked prefill and prefix
  hits with one mask. A single chunk with no cached context skips the gather (plain causal SDPA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.attention_metadata import (
    AttentionMetadata,
    DecodeBatch,
    PrefillBatch,
    build_attention_metadata,
)
from engine.kernels.kv_cache import PagedKVCache

__all__ = ["AttentionMetadata", "build_attention_metadata", "paged_attention"]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache and attend. query [tokens, heads, head_dim], key and
    value [tokens, kv_heads, head_dim]; returns [tokens, heads * head_dim]."""
    cache.write(layer, meta.slot_mapping, key, value)
    num_tokens, num_heads, head_dim = query.shape
    decode_out = prefill_out = None
    if meta.decode is not None:
        decode_out = _decode_attention(query, cache, layer, meta.decode, scale)
        if meta.decode.rows is None:
            return decode_out
    if meta.prefill is not None:
        prefill_out = _prefill_attention(query, key, value, cache, layer, meta.prefill, scale)
        if meta.prefill.rows is None:
            return prefill_out
    out = query.new_empty(num_tokens, num_heads * head_dim)
    for part, group in ((decode_out, meta.decode), (prefill_out, meta.prefill)):
        if part is not None and group is not None and group.rows is not None:
            out.index_copy_(0, group.rows, part)
    return out


def _decode_attention(
    query: torch.Tensor, cache: PagedKVCache, layer: int, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    q = query if batch.rows is None else query.index_select(0, batch.rows)
    kv_heads, head_dim = cache.keys[layer].shape[1:]
    seqs, kv_len = batch.num_seqs, batch.kv_len
    q = q.view(seqs, kv_heads, -1, head_dim)  # query heads of one KV head become query rows
    k = cache.keys[layer].index_select(0, batch.kv_slots).view(seqs, kv_len, kv_heads, head_dim)
    v = cache.values[layer].index_select(0, batch.kv_slots).view(seqs, kv_len, kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=batch.mask, scale=scale
    )
    return out.reshape(seqs, -1)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    batch: PrefillBatch,
    scale: float,
) -> torch.Tensor:
    if batch.kv_slots is None:  # one chunk, nothing cached before it: causal over its own K/V
        rows = batch.query_rows
        if batch.rows is not None:
            query, key, value = (t.index_select(0, rows) for t in (query, key, value))
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(rows.numel(), -1)
    kv_heads, head_dim = cache.keys[layer].shape[1:]
    chunks, query_len, kv_len = batch.num_chunks, batch.query_len, batch.kv_len
    group = query.shape[1] // kv_heads
    q = query.index_select(0, batch.query_rows).view(chunks, query_len, kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(chunks, kv_heads, group * query_len, head_dim)
    k = cache.keys[layer].index_select(0, batch.kv_slots).view(chunks, kv_len, kv_heads, head_dim)
    v = cache.values[layer].index_select(0, batch.kv_slots).view(chunks, kv_len, kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=batch.mask, scale=scale
    )
    out = out.view(chunks, kv_heads, group, query_len, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(chunks * query_len, kv_heads * group * head_dim)
    return out if batch.kept is None else out.index_select(0, batch.kept)
