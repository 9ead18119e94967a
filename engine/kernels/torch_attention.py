"""Paged attention in plain torch: one SDPA call per piece of the step (see attention_metadata)
over K/V gathered from the paged cache.

Grouped-query attention without K/V copies: the query heads that share one KV head are folded
into SDPA's query-length axis ([kv_heads, group * queries, head_dim] against [kv_heads, keys,
head_dim]), with the mask repeated per group to match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.attention_metadata import (
    AttentionMetadata,
    ChunkPrefill,
    DecodeBatch,
    PaddedPrefill,
    Piece,
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
    results = [
        (piece.rows, _attend(piece, query, key, value, cache, layer, scale))
        for piece in meta.pieces
    ]
    if len(results) == 1 and _covers_all(results[0][0], meta.num_tokens):
        return results[0][1]
    out = query.new_empty(meta.num_tokens, query.shape[1] * query.shape[2])
    for rows, part in results:
        if isinstance(rows, tuple):
            out[rows[0] : rows[1]] = part
        elif rows is not None:
            out.index_copy_(0, rows, part)
    return out


def _covers_all(rows: torch.Tensor | tuple[int, int] | None, num_tokens: int) -> bool:
    return rows is None or rows == (0, num_tokens)


def _attend(
    piece: Piece,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    scale: float,
) -> torch.Tensor:
    if isinstance(piece, DecodeBatch):
        return _decode(query, cache, layer, piece, scale)
    if isinstance(piece, PaddedPrefill):
        return _padded_prefill(query, cache, layer, piece, scale)
    return _chunk_prefill(query, key, value, cache, layer, piece, scale)


def _gather(
    cache: PagedKVCache, layer: int, slots: torch.Tensor, batch: int, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given slots as [batch, kv_heads, kv_len, head_dim] (strided views)."""
    kv_heads, head_dim = cache.keys[layer].shape[1:]
    shape = (batch, kv_len, kv_heads, head_dim)
    k = cache.keys[layer].index_select(0, slots).view(shape)
    v = cache.values[layer].index_select(0, slots).view(shape)
    return k.transpose(1, 2), v.transpose(1, 2)


def _decode(
    query: torch.Tensor, cache: PagedKVCache, layer: int, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    q = query if batch.rows is None else query.index_select(0, batch.rows)
    kv_heads = cache.keys[layer].shape[1]
    q = q.view(batch.num_seqs, kv_heads, -1, q.shape[-1])  # [seqs, kv_heads, group, head_dim]
    k, v = _gather(cache, layer, batch.kv_slots, batch.num_seqs, batch.kv_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=scale)
    return out.reshape(batch.num_seqs, -1)


def _padded_prefill(
    query: torch.Tensor, cache: PagedKVCache, layer: int, batch: PaddedPrefill, scale: float
) -> torch.Tensor:
    chunks, query_len = batch.num_chunks, batch.query_len
    heads, head_dim = query.shape[1:]
    kv_heads = cache.keys[layer].shape[1]
    q = query.index_select(0, batch.query_rows).view(chunks, query_len, kv_heads, -1, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(chunks, kv_heads, -1, head_dim)
    k, v = _gather(cache, layer, batch.kv_slots, chunks, batch.kv_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=scale)
    out = out.view(chunks, kv_heads, -1, query_len, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(chunks * query_len, heads * head_dim)
    return out if batch.kept is None else out.index_select(0, batch.kept)


def _chunk_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    piece: ChunkPrefill,
    scale: float,
) -> torch.Tensor:
    start, stop = piece.rows
    rows = stop - start
    heads, head_dim = query.shape[1:]
    if piece.kv_slots is None:  # causal over the chunk's own K/V
        q, k, v = (t[start:stop].transpose(0, 1)[None] for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(rows, heads * head_dim)
    kv_heads = cache.keys[layer].shape[1]
    q = query[start:stop].view(rows, kv_heads, -1, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(1, kv_heads, -1, head_dim)  # [1, kv_heads, group * rows, head_dim]
    k, v = _gather(cache, layer, piece.kv_slots, 1, piece.kv_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=piece.mask, scale=scale)
    out = out.view(kv_heads, -1, rows, head_dim).permute(2, 0, 1, 3)
    return out.reshape(rows, heads * head_dim)
