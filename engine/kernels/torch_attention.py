"""Paged attention in plain torch: index tensors built once per step, then one SDPA call per
layer for all decode tokens and one for all prefill chunks.

A step's chunks split into two groups:
- decode: chunks of one token. Their K/V are gathered by block table into a padded
  [seqs, max_context] batch; a mask hides the padding. The query heads that share one KV head
  are folded into SDPA's query-length axis, so grouped-query attention needs no K/V copies.
- prefill: longer chunks, padded to the longest. A chunk starting at `start_pos` attends to all
  cached positions before it and causally to itself, which covers chunked prefill and prefix
  hits with one mask. A single chunk with no cached context skips the gather (plain causal SDPA).
Padding positions gather the cache's zero slot, and padded query rows attend to key 0 only, so
nothing NaN can leak into real rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F

from engine.kernels.kv_cache import PagedKVCache

_BatchT = TypeVar("_BatchT", "DecodeBatch | None", "PrefillBatch | None")


@dataclasses.dataclass
class DecodeBatch:
    rows: torch.Tensor | None  # the step's token rows that are decode tokens; None = all rows
    kv_slots: torch.Tensor  # [seqs * kv_len] cache slots to gather (null slot as padding)
    mask: torch.Tensor  # [seqs, 1, 1, kv_len] bool, True = attend
    num_seqs: int
    kv_len: int


@dataclasses.dataclass
class PrefillBatch:
    rows: torch.Tensor | None  # the step's token rows that are prefill tokens; None = all rows
    query_rows: torch.Tensor  # [chunks * query_len] rows of the padded queries
    kept: torch.Tensor | None  # positions of real queries among the padded ones; None = all
    kv_slots: torch.Tensor | None  # [chunks * kv_len]; None = fresh causal (no gather)
    mask: torch.Tensor | None  # [chunks, 1, group * query_len, kv_len]
    num_chunks: int
    query_len: int
    kv_len: int


@dataclasses.dataclass
class AttentionMetadata:
    num_tokens: int
    positions: torch.Tensor  # [tokens] position of each token in its sequence
    slot_mapping: torch.Tensor  # [tokens] cache slot each token's K/V is written to
    decode: DecodeBatch | None
    prefill: PrefillBatch | None


def build_attention_metadata(
    query_lens: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    cache: PagedKVCache,
    queries_per_kv: int,
    device: torch.device,
) -> AttentionMetadata:
    """Index tensors for one step; chunk i has query_lens[i] tokens from start_positions[i]."""
    block_size = cache.block_size
    context_lens = [s + q for s, q in zip(start_positions, query_lens, strict=True)]
    tables = _padded_block_tables(block_tables, context_lens, block_size, cache.num_blocks)
    num_tokens = sum(query_lens)
    if num_tokens == len(query_lens):  # decode only: one token per chunk
        positions = torch.tensor(start_positions, dtype=torch.long)
        slot_mapping = _slots(tables, positions[:, None], block_size).view(-1)
        decode = _decode_batch(None, tables, context_lens, cache.null_slot, block_size)
        return AttentionMetadata(
            num_tokens, positions.to(device), slot_mapping.to(device), _to(decode, device), None
        )

    lens = torch.tensor(query_lens, dtype=torch.long)
    starts = torch.tensor(start_positions, dtype=torch.long)
    token_chunk = torch.repeat_interleave(torch.arange(len(query_lens)), lens)
    first_row = torch.cumsum(lens, 0) - lens
    offsets = torch.arange(num_tokens) - first_row[token_chunk]
    positions = starts[token_chunk] + offsets
    slot_mapping = tables[token_chunk, positions // block_size] * block_size + (
        positions % block_size
    )

    is_decode = [q == 1 for q in query_lens]
    decode = None
    if any(is_decode):
        decode_chunks = torch.tensor([i for i, d in enumerate(is_decode) if d])
        decode = _decode_batch(
            first_row[decode_chunks],
            tables[decode_chunks],
            [c for c, d in zip(context_lens, is_decode, strict=True) if d],
            cache.null_slot,
            block_size,
        )
    prefill_chunks = [i for i, d in enumerate(is_decode) if not d]
    prefill = _prefill_batch(
        prefill_chunks,
        query_lens,
        start_positions,
        context_lens,
        first_row,
        tables,
        token_chunk,
        all_prefill=decode is None,
        queries_per_kv=queries_per_kv,
        null_slot=cache.null_slot,
        block_size=block_size,
    )
    return AttentionMetadata(
        num_tokens,
        positions.to(device),
        slot_mapping.to(device),
        _to(decode, device),
        _to(prefill, device),
    )


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


def _padded_block_tables(
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    block_size: int,
    num_blocks: int,
) -> torch.Tensor:
    """[chunks, max blocks] of the blocks each chunk's context needs, padded with block 0."""
    needed = [-(-c // block_size) for c in context_lens]
    width = max(needed)
    rows = []
    for table, n, context in zip(block_tables, needed, context_lens, strict=True):
        if len(table) < n:
            raise ValueError(
                f"block table {list(table)} covers {len(table) * block_size} tokens but the "
                f"chunk reaches position {context - 1} (block size {block_size}); "
                f"expected at least {n} blocks"
            )
        rows.append([*table[:n], *([0] * (width - n))])
    tables = torch.tensor(rows, dtype=torch.long)
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise ValueError(
            f"block ids must be in [0, {num_blocks}); got a table row with "
            f"{int(tables.min())}..{int(tables.max())}"
        )
    return tables


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position [chunks, n] through the chunk's block table row."""
    return tables.gather(1, positions // block_size) * block_size + positions % block_size


def _decode_batch(
    rows: torch.Tensor | None,
    tables: torch.Tensor,
    context_lens: Sequence[int],
    null_slot: int,
    block_size: int,
) -> DecodeBatch:
    kv_len = max(context_lens)
    key_positions = torch.arange(kv_len).expand(tables.shape[0], kv_len)
    visible = key_positions < torch.tensor(context_lens)[:, None]
    slots = torch.where(visible, _slots(tables, key_positions, block_size), null_slot)
    return DecodeBatch(rows, slots.view(-1), visible[:, None, None, :], len(context_lens), kv_len)


def _prefill_batch(
    chunks: list[int],
    query_lens: Sequence[int],
    start_positions: Sequence[int],
    context_lens: Sequence[int],
    first_row: torch.Tensor,
    tables: torch.Tensor,
    token_chunk: torch.Tensor,
    *,
    all_prefill: bool,
    queries_per_kv: int,
    null_slot: int,
    block_size: int,
) -> PrefillBatch | None:
    if not chunks:
        return None
    index = torch.tensor(chunks)
    lens = torch.tensor([query_lens[i] for i in chunks])
    starts = torch.tensor([start_positions[i] for i in chunks])
    contexts = [context_lens[i] for i in chunks]
    query_len, kv_len = int(lens.max()), max(contexts)
    rows = None if all_prefill else torch.nonzero(lens.new_tensor(query_lens)[token_chunk] > 1)
    rows = None if rows is None else rows.view(-1)
    if len(chunks) == 1 and start_positions[chunks[0]] == 0:
        first = int(first_row[chunks[0]])
        query_rows = torch.arange(first, first + query_len)
        return PrefillBatch(rows, query_rows, None, None, None, 1, query_len, query_len)

    query_offsets = torch.arange(query_len)
    real_query = query_offsets[None, :] < lens[:, None]  # [chunks, query_len]
    query_rows = torch.where(real_query, first_row[index][:, None] + query_offsets, 0)
    key_positions = torch.arange(kv_len)
    query_positions = starts[:, None] + query_offsets[None, :]
    mask = key_positions[None, None, :] <= query_positions[:, :, None]
    mask = torch.where(real_query[:, :, None], mask, key_positions == 0)  # padding: key 0 only
    mask = mask[:, None].expand(-1, queries_per_kv, -1, -1)
    mask = mask.reshape(len(chunks), 1, queries_per_kv * query_len, kv_len)
    visible = key_positions[None, :] < torch.tensor(contexts)[:, None]
    key_slots = _slots(tables[index], key_positions.expand(len(chunks), kv_len), block_size)
    kv_slots = torch.where(visible, key_slots, null_slot).view(-1)
    kept = None if bool(real_query.all()) else torch.nonzero(real_query.view(-1)).view(-1)
    return PrefillBatch(
        rows, query_rows.view(-1), kept, kv_slots, mask, len(chunks), query_len, kv_len
    )


def _to(batch: _BatchT, device: torch.device) -> _BatchT:
    """The batch with its index tensors on `device` (built on the CPU, where Python lives)."""
    if batch is None or device.type == "cpu":
        return batch
    moved = {
        field.name: value.to(device, non_blocking=True)
        if isinstance(value, torch.Tensor)
        else value
        for field in dataclasses.fields(batch)
        for value in [getattr(batch, field.name)]
    }
    return dataclasses.replace(batch, **moved)
