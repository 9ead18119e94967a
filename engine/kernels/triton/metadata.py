"""Per-step index tensors for the Triton attention kernels, built once per step on the host and
shared by every layer.

Unlike the torch backend, nothing is gathered or padded per key: the kernels walk each chunk's
block table themselves. A step's chunks split into two kernel launches by query length:
- decode chunks (one token): split-K decode over the context (decode_attention);
- extend chunks (two or more tokens): causal attention over cached context plus the chunk
  (extend_attention).
Empty chunks have no rows and belong to neither.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from engine.kernels.attention_metadata import long_tensor
from engine.kernels.kv_cache import PagedKVCache


@dataclasses.dataclass
class TritonAttentionMetadata:
    num_tokens: int
    positions: torch.Tensor  # [tokens] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [tokens] int64, cache slot each token's K/V is written to
    block_tables: torch.Tensor  # [chunks, max blocks] int32, padded with block 0 (never read)
    query_starts: torch.Tensor  # [chunks + 1] int32, first step row of each chunk
    context_lens: torch.Tensor  # [chunks] int32, cached tokens once this step's are written
    decode_chunks: torch.Tensor  # [decodes] int32, chunks of exactly one token
    extend_chunks: torch.Tensor  # [extends] int32, chunks of two or more tokens
    max_decode_context: int  # longest decode context (sets the number of K splits)
    max_extend_len: int  # longest extend chunk (sets the number of query tiles)


def build_triton_attention_metadata(
    query_lens: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    cache: PagedKVCache,
    queries_per_kv: int,
    device: torch.device,
) -> TritonAttentionMetadata:
    """Index tensors for one step; chunk i has query_lens[i] tokens from start_positions[i].
    (queries_per_kv is part of the backend signature; these kernels read it from the shapes.)"""
    del queries_per_kv
    block_size = cache.block_size
    context_lens = [s + n for s, n in zip(start_positions, query_lens, strict=True)]
    tables = _block_table_tensor(block_tables, context_lens, block_size, cache.num_blocks)
    first_rows = list(itertools.accumulate(query_lens, initial=0))
    num_tokens = first_rows[-1]
    token_chunk = torch.repeat_interleave(torch.arange(len(query_lens)), long_tensor(query_lens))
    offsets = long_tensor([s - r for s, r in zip(start_positions, first_rows[:-1], strict=True)])
    positions = offsets[token_chunk] + torch.arange(num_tokens)
    slot_mapping = tables[token_chunk, positions // block_size].long() * block_size + (
        positions % block_size
    )
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    extend = [i for i, n in enumerate(query_lens) if n > 1]
    return TritonAttentionMetadata(
        num_tokens=num_tokens,
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        block_tables=tables.to(device),
        query_starts=_int32(first_rows, device),
        context_lens=_int32(context_lens, device),
        decode_chunks=_int32(decode, device),
        extend_chunks=_int32(extend, device),
        max_decode_context=max((context_lens[i] for i in decode), default=0),
        max_extend_len=max((query_lens[i] for i in extend), default=0),
    )


def _int32(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device)


def _block_table_tensor(
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    block_size: int,
    num_blocks: int,
) -> torch.Tensor:
    """[chunks, max blocks needed] int32; a table too short for its chunk, or a block id out of
    range, is an error here rather than a stray read or write on the device."""
    needed = [-(-context // block_size) for context in context_lens]
    tables = torch.zeros(len(needed), max(needed, default=0), dtype=torch.int32)
    for row, (table, count) in enumerate(zip(block_tables, needed, strict=True)):
        if len(table) < count:
            raise ValueError(
                f"block table {list(table)} covers {len(table) * block_size} tokens but chunk "
                f"{row} reaches position {context_lens[row] - 1} (block size {block_size}); "
                f"expected at least {count} blocks"
            )
        if count:
            tables[row, :count] = long_tensor(table[:count])
    if tables.numel() and not (int(tables.min()) >= 0 and int(tables.max()) < num_blocks):
        bad = next(b for b in tables.view(-1).tolist() if not 0 <= b < num_blocks)
        raise ValueError(f"block id {bad} is out of range; expected 0 <= id < {num_blocks}")
    return tables
