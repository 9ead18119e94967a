"""Paged attention in plain torch, one call per piece of the step (see attention_metadata).

Decode tokens and short chunks attend in place: the scores are a sampled matrix product (query
rows against only the cache rows each one may see, `torch.sparse.sampled_addmm`), softmax runs
per row, and the output is a weighted sum of value rows read where they lie (`embedding_bag`
with per-sample weights). K and V are never copied.

A cache of another dtype than the query's (a compact one: 16-bit or int8 rows) is read by gathering
the rows each token sees and widening them to float32.

Long prefill chunks use SDPA: on their own K/V, or on their context gathered once per chunk
(amortised over the chunk's many queries). There grouped-query attention needs no K/V copies:
the query heads that share one KV head are folded into SDPA's query-length axis ([kv_heads,
group * queries, head_dim] against [kv_heads, keys, head_dim]), the mask repeated to match.

Two variants of a layer (the families' `window` and `softcap`): a sliding window hides the keys
more than window - 1 positions before a token (masked where the scores are laid out by key
position), and soft-capping maps each score s to cap * tanh(s / cap) before the softmax, which
SDPA cannot do: such prefill chunks take the same arithmetic written out (`_explicit`).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
import torch.nn.functional as F

from engine.kernels.attention_metadata import (
    AttentionMetadata,
    ChunkPrefill,
    Piece,
    SlotRows,
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
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache and attend. query [tokens, heads, head_dim], key and
    value [tokens, kv_heads, head_dim]; returns [tokens, heads * head_dim]. `window`: a token
    sees itself and the window - 1 keys before it (None: every key before it); `softcap`: the
    scores are soft-capped (None: not)."""
    cache.write(layer, meta.slot_mapping, key, value)
    variant = Variant(window, softcap)
    results = [
        (piece.rows, _attend(piece, query, key, value, cache, layer, scale, variant))
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


@dataclasses.dataclass(frozen=True)
class Variant:
    window: int | None = None
    softcap: float | None = None

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return scores
        return torch.tanh(scores / self.softcap) * self.softcap


PLAIN = Variant()


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
    variant: Variant,
) -> torch.Tensor:
    if isinstance(piece, SlotRows):
        return _slot_rows(query, cache, layer, piece, scale, variant)
    if isinstance(piece, ChunkPrefill):
        return chunk_prefill(query, key, value, cache, layer, piece, scale, variant)
    raise TypeError(f"the torch kernel backend got a {type(piece).__name__} piece")


def _slot_rows(
    query: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    piece: SlotRows,
    scale: float,
    variant: Variant = PLAIN,
) -> torch.Tensor:
    rows = piece.rows
    if rows is None:
        q = query
    elif isinstance(rows, tuple):  # [start, stop)
        q = query[rows[0] : rows[1]]
    else:
        q = query.index_select(0, rows)
    num_tokens, heads, head_dim = q.shape
    if cache.dtype != q.dtype:
        return _compact_slot_rows(q, cache, layer, piece, scale, variant)
    keys = cache.keys[layer].view(-1, head_dim)  # [slots * kv_heads, head_dim]
    values = cache.values[layer].view(-1, head_dim)
    scores = variant.cap(_sampled_scores(piece.pattern, q.reshape(-1, head_dim), keys, scale))
    probs = _probabilities(scores, piece, num_tokens * heads, variant)
    out = F.embedding_bag(
        piece.pattern.col_indices(),
        values,
        piece.pattern.crow_indices(),
        mode="sum",
        per_sample_weights=probs.to(values.dtype),
        include_last_offset=True,
    )
    return out.view(num_tokens, heads * head_dim)


def _probabilities(
    scores: torch.Tensor, piece: SlotRows, rows: int, variant: Variant
) -> torch.Tensor:
    """Softmax of each pattern row's scores (in the pattern's order)."""
    if variant.window is not None:
        return _windowed_probs(scores, piece, variant.window)
    if piece.grid_index is None:
        return scores.view(-1, piece.longest).softmax(-1).view(-1)
    grid = scores.new_full((rows * piece.longest,), float("-inf"))
    grid.index_copy_(0, piece.grid_index, scores)
    return grid.view(-1, piece.longest).softmax(-1).view(-1).index_select(0, piece.grid_index)


def _compact_slot_rows(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    piece: SlotRows,
    scale: float,
    variant: Variant,
) -> torch.Tensor:
    """_slot_rows for a cache of another dtype: each (token, head) row's keys and values
    gathered, widened to float32, scored and summed there."""
    num_tokens, heads, head_dim = q.shape
    columns = piece.pattern.col_indices()
    pattern_rows = torch.repeat_interleave(piece.pattern.crow_indices().diff())
    width = cache.keys[layer].shape[-1]
    keys = cache.decode(cache.keys[layer].view(-1, width)[columns], torch.float32)
    queries = q.float().reshape(-1, head_dim).index_select(0, pattern_rows)
    scores = variant.cap((keys * queries).sum(-1) * scale)
    probs = _probabilities(scores, piece, num_tokens * heads, variant)
    values = cache.decode(cache.values[layer].view(-1, width)[columns], torch.float32)
    out = values.new_zeros(num_tokens * heads, head_dim)
    out.index_add_(0, pattern_rows, values * probs[:, None])
    return out.view(num_tokens, heads * head_dim).to(q.dtype)


def _windowed_probs(scores: torch.Tensor, piece: SlotRows, window: int) -> torch.Tensor:
    """Softmax of each row's scores over its last `window` keys: in the grid a row's keys lie
    by position (0 .. seen - 1), so the hidden ones are the columns before seen - window."""
    seen = piece.pattern.crow_indices().diff()  # keys of each (token, head) row
    rows = seen.numel()
    grid = scores.new_full((rows * piece.longest,), float("-inf"))
    if piece.grid_index is None:
        grid.copy_(scores)
    else:
        grid.index_copy_(0, piece.grid_index, scores)
    grid = grid.view(rows, piece.longest)
    columns = torch.arange(piece.longest, device=grid.device)
    grid.masked_fill_(columns[None, :] < (seen - window)[:, None], float("-inf"))
    probs = grid.softmax(-1).view(-1)
    return probs if piece.grid_index is None else probs.index_select(0, piece.grid_index)


def _sampled_scores(
    pattern: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """scale * q[row] . keys[column] for every (row, column) of the pattern, in its order."""
    if keys.dtype in (torch.float32, torch.float64):
        scores = torch.sparse.sampled_addmm(pattern, q, keys.t(), beta=0.0, alpha=scale)
        return cast(torch.Tensor, scores.values())
    # torch's sampled_addmm has no half-precision kernel, on the CPU or on CUDA (torch 2.11 on an
    # H200 said so): gather the keys each row sees (a copy of K only) and accumulate in float32.
    rows = torch.repeat_interleave(pattern.crow_indices().diff())
    picked = keys.index_select(0, pattern.col_indices()).float()
    return (picked * q.float().index_select(0, rows)).sum(-1) * scale


def _gather(
    cache: PagedKVCache,
    layer: int,
    slots: torch.Tensor,
    batch: int,
    kv_len: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given slots as [batch, kv_heads, kv_len, head_dim] of `dtype` (strided
    views)."""
    shape = (batch, kv_len, cache.num_kv_heads, cache.head_dim)
    k, v = cache.gather(layer, slots, dtype)
    return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)


def chunk_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    piece: ChunkPrefill,
    scale: float,
    variant: Variant = PLAIN,
) -> torch.Tensor:
    start, stop = piece.rows
    rows = stop - start
    heads, head_dim = query.shape[1:]
    if piece.kv_slots is None and variant == PLAIN:  # causal over the chunk's own K/V
        q, k, v = (t[start:stop].transpose(0, 1)[None] for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(rows, heads * head_dim)
    kv_heads = cache.num_kv_heads
    q = query[start:stop].view(rows, kv_heads, -1, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(1, kv_heads, -1, head_dim)  # [1, kv_heads, group * rows, head_dim]
    if piece.kv_slots is None:
        k, v = (t[start:stop].transpose(0, 1)[None] for t in (key, value))
    else:
        k, v = _gather(cache, layer, piece.kv_slots, 1, piece.kv_len, query.dtype)
    mask = piece.mask
    if variant == PLAIN:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        mask = _variant_mask(mask, rows, piece.kv_len, heads // kv_heads, variant.window)
        out = _explicit(q, k, v, mask, scale, variant)
    out = out.view(kv_heads, -1, rows, head_dim).permute(2, 0, 1, 3)
    return out.reshape(rows, heads * head_dim)


def _variant_mask(
    mask: torch.Tensor | None, rows: int, kv_len: int, group: int, window: int | None
) -> torch.Tensor:
    """The chunk's mask [1, 1, group * rows, kv_len] (causal where it had none), with the keys
    outside each query's window hidden too; the queries are the last `rows` positions."""
    query_positions = torch.arange(kv_len - rows, kv_len)[:, None]
    keys = torch.arange(kv_len)[None, :]
    visible = keys <= query_positions
    if window is not None:
        visible &= keys > query_positions - window
    folded = visible.repeat(group, 1)[None, None]
    return folded if mask is None else mask & folded


def _explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    variant: Variant,
) -> torch.Tensor:
    """SDPA's arithmetic with the scores soft-capped where the variant caps them: q [1,
    kv_heads, queries, head_dim], k and v [1, kv_heads, keys, head_dim], mask [1, 1, queries,
    keys]."""
    scores = variant.cap(torch.matmul(q, k.transpose(-1, -2)) * scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v)
