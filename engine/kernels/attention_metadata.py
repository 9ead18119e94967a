"""Per-step index tensors for the torch paged-attention backend, built once and shared by every
layer.

A step's chunks become a few attention calls ("pieces"):
- decode tokens and short prefill chunks (<= SHORT_CHUNK tokens, e.g. prompt suffixes after a
  prefix hit) together in one piece that reads K and V where they lie in the cache (no copy of
  the context, no padding). For the torch kernels that is a `SlotRows` piece: every (token,
  query head) is one row of a sparse [rows, cache slots x kv heads] pattern listing the keys it
  may see. For the compiled CPU kernel (engine/kernels/cpu) it is a `TableRows` piece: each
  token walks its chunk's block table itself, so only the tables and counts are built;
- every other prefill chunk alone: plain causal attention over its own K/V when nothing is
  cached before it, else its queries in tiles, each with the keys it may see gathered (a copy of
  the context once per chunk, amortised over its > SHORT_CHUNK queries).
Work is done in Python where it is per chunk and in torch where it is per token or per key.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch

from engine.kernels.kv_cache import PagedKVCache

SHORT_CHUNK = 32  # prefill chunks up to this many tokens attend in place with the decodes
MASK_BUDGET = 1 << 25  # most mask elements one prefill tile may build

Rows = torch.Tensor | tuple[int, int] | None  # token rows of a piece: index, [start, stop), all


@dataclasses.dataclass
class SlotRows:
    """Tokens whose every query head attends to the keys it may see where they lie in the cache.

    `pattern` is a sparse CSR matrix [tokens * heads, slots * kv_heads]: row (token, head) lists,
    in position order, the rows of the cache viewed as [slots * kv_heads, head_dim] that hold the
    keys that head may see. Softmax runs on the scores placed in a [tokens * heads, longest] grid
    at `grid_index`, -inf elsewhere (None: every row sees `longest` keys, no grid needed)."""

    rows: Rows
    pattern: torch.Tensor
    grid_index: torch.Tensor | None
    longest: int


@dataclasses.dataclass
class TableRows:
    """Tokens that attend, every query head, to keys 0..seen-1 of their chunk, read through the
    chunk's block table where they lie in the cache (the compiled CPU kernel's piece)."""

    rows: torch.Tensor | None  # [tokens] step row of each token; None: every row, in order
    tables: torch.Tensor  # [chunks, max blocks] int64 block tables, padded with block 0
    token_chunk: torch.Tensor  # [tokens] int64 row of `tables` each token reads
    seen: torch.Tensor  # [tokens] int64 keys each token attends to: its position + 1
    keys: int  # sum of `seen`: how much the piece reads (sets the kernel's thread count)


@dataclasses.dataclass
class ChunkPrefill:
    """Rows [start, stop) of one chunk: causal on their own K/V when kv_slots is None, else
    attending to the gathered keys under `mask` [1, 1, group * rows, kv_len]."""

    rows: tuple[int, int]
    kv_slots: torch.Tensor | None
    mask: torch.Tensor | None
    kv_len: int


Piece = SlotRows | TableRows | ChunkPrefill
InPlace = Literal["sparse", "table"]  # which piece the short chunks become


@dataclasses.dataclass
class AttentionMetadata:
    num_tokens: int
    positions: torch.Tensor  # [tokens] position of each token in its sequence
    slot_mapping: torch.Tensor  # [tokens] cache slot each token's K/V is written to
    pieces: list[Piece]  # one SDPA call each; together they cover every token row once


_arange_cache = torch.arange(1024)


def build_attention_metadata(
    query_lens: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    cache: PagedKVCache,
    queries_per_kv: int,
    device: torch.device,
    in_place: InPlace = "sparse",
) -> AttentionMetadata:
    """Index tensors for one step; chunk i has query_lens[i] tokens from start_positions[i].
    `in_place`: the piece short chunks become (SlotRows for "sparse", TableRows for "table")."""
    block_size = cache.block_size
    context_lens = [s + q for s, q in zip(start_positions, query_lens, strict=True)]
    tables = _padded_block_tables(block_tables, context_lens, block_size, cache.num_blocks)
    first_rows = list(itertools.accumulate(query_lens, initial=0))
    num_tokens = first_rows.pop()
    layout = _StepLayout(
        query_lens, start_positions, context_lens, first_rows, tables, cache, queries_per_kv
    )

    if num_tokens == len(query_lens):  # one token per chunk: plain Python is cheaper
        positions = long_tensor(start_positions)
        slot_mapping = long_tensor(
            [
                table[p // block_size] * block_size + p % block_size
                for table, p in zip(block_tables, start_positions, strict=True)
            ]
        )
    else:
        token_chunk = torch.repeat_interleave(_arange(len(query_lens)), long_tensor(query_lens))
        offsets = long_tensor([s - r for s, r in zip(start_positions, first_rows, strict=True)])
        positions = offsets[token_chunk] + _arange(num_tokens)
        slot_mapping = tables[token_chunk, positions // block_size] * block_size + (
            positions % block_size
        )

    pieces: list[Piece] = []
    short = [i for i, n in enumerate(query_lens) if n <= SHORT_CHUNK]
    if short:
        all_rows = len(short) == len(query_lens)
        if in_place == "table":
            pieces.append(layout.table_rows(short, all_rows=all_rows, positions=positions))
        else:
            pieces.append(layout.slot_rows(short, all_rows=all_rows))
    for i in range(len(query_lens)):
        if query_lens[i] > SHORT_CHUNK:
            pieces.extend(layout.chunk_prefill(i))
    return AttentionMetadata(
        num_tokens,
        positions.to(device),
        slot_mapping.to(device),
        [_to(piece, device) for piece in pieces],
    )


def long_tensor(values: Iterable[int]) -> torch.Tensor:
    """An int64 CPU tensor of Python ints, via array: it packs the ints in one C loop, where
    torch.tensor inspects each element's type first."""
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _arange(n: int) -> torch.Tensor:
    """0..n-1 without allocating each step (a view of one cached arange)."""
    global _arange_cache
    if n > _arange_cache.numel():
        _arange_cache = torch.arange(max(n, 2 * _arange_cache.numel()))
    return _arange_cache[:n]


@dataclasses.dataclass
class _StepLayout:
    """The step's chunks, and how to turn groups of them into attention pieces."""

    query_lens: Sequence[int]
    start_positions: Sequence[int]
    context_lens: list[int]
    first_rows: list[int]
    tables: torch.Tensor
    cache: PagedKVCache
    queries_per_kv: int

    def table_rows(
        self, chunks: list[int], *, all_rows: bool, positions: torch.Tensor
    ) -> TableRows:
        """`positions`: of every token of the step (those of `chunks` are taken from it)."""
        rows = None if all_rows else self._rows(chunks)
        seen = positions + 1 if rows is None else positions[rows] + 1
        tables = self.tables if rows is None else self.tables[long_tensor(chunks)]
        return TableRows(rows, tables, self._token_chunk(chunks), seen, int(seen.sum()))

    def slot_rows(self, chunks: list[int], *, all_rows: bool) -> SlotRows:
        kv_heads = self.cache.keys[0].shape[1]
        heads = kv_heads * self.queries_per_kv
        lens = long_tensor(self.query_lens[i] for i in chunks)
        longest = max(self.context_lens[i] for i in chunks)
        tables = self.tables if all_rows else self.tables[long_tensor(chunks)]
        key_slots = self._key_slots(tables, longest)  # [chunks, longest]
        token_chunk = self._token_chunk(chunks)
        first = torch.cumsum(lens, 0) - lens
        starts = long_tensor(self.start_positions[i] for i in chunks)
        positions = starts[token_chunk] + _arange(token_chunk.numel()) - first[token_chunk]
        kv_head = _arange(heads) // self.queries_per_kv
        # [tokens, heads, longest]: cache rows of every key, real or past the token's position
        cache_rows = key_slots[token_chunk][:, None, :] * kv_heads + kv_head[:, None]
        seen = positions + 1  # keys each token sees: its own position and every earlier one
        visible = (_arange(longest) < seen[:, None])[:, None, :].expand_as(cache_rows)
        crow = torch.cat((_arange(1), torch.cumsum(seen.repeat_interleave(heads), 0)))
        if int(seen.min()) == longest:
            grid_index, columns = None, cache_rows.reshape(-1)
        else:
            grid_index = torch.nonzero(visible.reshape(-1)).view(-1)
            columns = cache_rows.reshape(-1)[grid_index]
        pattern = _csr_pattern(crow, columns, self.cache)
        return SlotRows(None if all_rows else self._rows(chunks), pattern, grid_index, longest)

    def _token_chunk(self, chunks: list[int]) -> torch.Tensor:
        """[tokens of `chunks`] the index in `chunks` of each token's chunk."""
        if all(self.query_lens[i] == 1 for i in chunks):
            return _arange(len(chunks))
        lens = long_tensor(self.query_lens[i] for i in chunks)
        return torch.repeat_interleave(_arange(len(chunks)), lens)

    def _rows(self, chunks: list[int]) -> torch.Tensor:
        """The step rows of the tokens of `chunks`, in order."""
        first = self.first_rows
        ranges = (range(first[i], first[i] + self.query_lens[i]) for i in chunks)
        return long_tensor(itertools.chain.from_iterable(ranges))

    def chunk_prefill(self, i: int) -> list[ChunkPrefill]:
        first, length, start = self.first_rows[i], self.query_lens[i], self.start_positions[i]
        if start == 0:  # nothing cached before it: causal over its own K/V, any length
            return [ChunkPrefill((first, first + length), None, None, length)]
        tile = max(16, MASK_BUDGET // (self.queries_per_kv * self.context_lens[i]))
        pieces = []
        for offset in range(0, length, tile):
            rows = min(tile, length - offset)
            kv_len = start + offset + rows
            query_positions = _arange(start + offset + rows)[start + offset :]
            mask = _arange(kv_len) <= query_positions[:, None]  # [rows, kv_len]
            mask = self._fold(mask[None, None]).reshape(1, 1, -1, kv_len)
            slots = self._key_slots(self.tables[i : i + 1], kv_len)
            pieces.append(
                ChunkPrefill(
                    (first + offset, first + offset + rows), slots.reshape(-1), mask, kv_len
                )
            )
        return pieces

    def _fold(self, mask: torch.Tensor) -> torch.Tensor:
        """[chunks, 1, queries, keys] -> [chunks, group, queries, keys]: the query heads that
        share a KV head become extra query rows (see torch_attention)."""
        return mask.expand(-1, self.queries_per_kv, -1, -1)

    def _key_slots(self, tables: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Cache slots of keys 0..kv_len-1 per chunk [chunks, kv_len] (past a chunk's context:
        whatever its padded table row points at, for callers to mask)."""
        block_size = self.cache.block_size
        width = -(-kv_len // block_size)
        slots = (tables[:, :width] * block_size).unsqueeze(2) + _arange(block_size)
        return slots.view(tables.shape[0], width * block_size)[:, :kv_len]


def _csr_pattern(crow: torch.Tensor, columns: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
    """The sparse [rows, cache rows] matrix with `columns` per row (zero values: only the pattern
    is used)."""
    num_cache_rows = cache.keys[0].shape[0] * cache.keys[0].shape[1]
    values = torch.zeros(columns.numel(), dtype=cache.storage.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "sparse CSR is in beta" notice
        return torch.sparse_csr_tensor(
            crow, columns, values, (crow.numel() - 1, num_cache_rows), check_invariants=False
        )


def _padded_block_tables(
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    block_size: int,
    num_blocks: int,
) -> torch.Tensor:
    """[chunks, max blocks] of the blocks each chunk's context needs, padded with block 0."""
    rows = []
    for table, context in zip(block_tables, context_lens, strict=True):
        needed = -(-context // block_size)
        if len(table) < needed:
            raise ValueError(
                f"block table {list(table)} covers {len(table) * block_size} tokens but the "
                f"chunk reaches position {context - 1} (block size {block_size}); "
                f"expected at least {needed} blocks"
            )
        rows.append(table[:needed])
    width = max(map(len, rows))
    flat = array("q")
    for row in rows:
        flat.extend(row)
        flat.extend(itertools.repeat(0, width - len(row)))
    if min(flat) < 0 or max(flat) >= num_blocks:
        bad = next(b for b in flat if not 0 <= b < num_blocks)
        raise ValueError(f"block id {bad} is out of range; expected 0 <= id < {num_blocks}")
    return torch.frombuffer(flat, dtype=torch.int64).view(len(rows), width)


def _to(piece: Piece, device: torch.device) -> Piece:
    """The piece with its index tensors on `device` (built on the CPU, where Python lives)."""
    if device.type == "cpu":
        return piece
    moved: dict[str, Any] = {
        field.name: value.to(device, non_blocking=True)
        for field in dataclasses.fields(piece)
        if isinstance(value := getattr(piece, field.name), torch.Tensor)
    }
    return dataclasses.replace(piece, **moved)
