"""Per-step index tensors for the torch paged-attention backend, built once and shared by every
layer.

A step's chunks become a few attention calls ("pieces"), each one SDPA call per layer:
- decode tokens (chunks of one token), gathered by block table into a padded
  [seqs, max context] batch with a mask; sequences are bucketed by context length (powers of
  two above 256) so one long context does not make every short one pay for its padding;
- short prefill chunks (<= SHORT_CHUNK tokens, e.g. prompt suffixes after a prefix hit),
  padded together the same way, with a causal mask offset by each chunk's start;
- every other prefill chunk alone: plain causal attention over its own K/V when nothing is
  cached before it, else its queries in tiles, each with the keys it may see.
Padding gathers the cache's zero slot, so nothing that was never written is read. Work is done
in Python where it is per chunk and in torch where it is per token or per key.
"""

from __future__ import annotations

import dataclasses
import itertools
from array import array
from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch

from engine.kernels.kv_cache import PagedKVCache

SHORT_CHUNK = 32  # prefill chunks up to this many tokens are batched with padding
DECODE_BUCKET_MIN = 256  # decode contexts up to this share one bucket
MASK_BUDGET = 1 << 25  # most mask elements one prefill tile may build

Rows = torch.Tensor | tuple[int, int] | None  # token rows of a piece: index, [start, stop), all


@dataclasses.dataclass
class DecodeBatch:
    rows: Rows
    kv_slots: torch.Tensor  # [seqs * kv_len] cache slots to gather (null slot as padding)
    mask: torch.Tensor  # [seqs, 1, 1, kv_len] bool, True = attend
    num_seqs: int
    kv_len: int


@dataclasses.dataclass
class PaddedPrefill:
    """Several short chunks padded to the longest; queries sharing a KV head are folded."""

    rows: Rows
    query_rows: torch.Tensor  # [chunks * query_len] step rows of the padded queries
    kept: torch.Tensor | None  # positions of real queries among the padded ones; None = all
    kv_slots: torch.Tensor  # [chunks * kv_len]
    mask: torch.Tensor  # [chunks, 1, group * query_len, kv_len], True = attend
    num_chunks: int
    query_len: int
    kv_len: int


@dataclasses.dataclass
class ChunkPrefill:
    """Rows [start, stop) of one chunk: causal on their own K/V when kv_slots is None, else
    attending to the gathered keys under `mask` [1, 1, group * rows, kv_len]."""

    rows: tuple[int, int]
    kv_slots: torch.Tensor | None
    mask: torch.Tensor | None
    kv_len: int


Piece = DecodeBatch | PaddedPrefill | ChunkPrefill


@dataclasses.dataclass
class AttentionMetadata:
    num_tokens: int
    positions: torch.Tensor  # [tokens] position of each token in its sequence
    slot_mapping: torch.Tensor  # [tokens] cache slot each token's K/V is written to
    pieces: list[Piece]  # one SDPA call each; together they cover every token row once


_PieceT = TypeVar("_PieceT", DecodeBatch, PaddedPrefill, ChunkPrefill)
_arange_cache = torch.arange(1024)


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

    decode = [i for i, n in enumerate(query_lens) if n == 1]
    short = [i for i, n in enumerate(query_lens) if 1 < n <= SHORT_CHUNK]
    if len(short) == 1:
        short = []  # alone, a short chunk is just a chunk
    batched = set(short)
    long = [i for i, n in enumerate(query_lens) if n > 1 and i not in batched]
    pieces: list[Piece] = []
    buckets: dict[int, list[int]] = {}
    for i in decode:
        buckets.setdefault(_decode_bucket(context_lens[i]), []).append(i)
    for chunks in buckets.values():
        pieces.append(layout.decode_batch(chunks, all_rows=len(chunks) == len(query_lens)))
    if short:
        pieces.append(layout.padded_prefill(short, all_rows=len(short) == len(query_lens)))
    for i in long:
        pieces.extend(layout.chunk_prefill(i))
    return AttentionMetadata(
        num_tokens,
        positions.to(device),
        slot_mapping.to(device),
        [_to(piece, device) for piece in pieces],
    )


def long_tensor(values: Iterable[int]) -> torch.Tensor:
    """An int64 CPU tensor of Python ints, via array (several times faster than torch.tensor)."""
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _arange(n: int) -> torch.Tensor:
    """0..n-1 without allocating each step (a view of one cached arange)."""
    global _arange_cache
    if n > _arange_cache.numel():
        _arange_cache = torch.arange(max(n, 2 * _arange_cache.numel()))
    return _arange_cache[:n]


def _decode_bucket(context_len: int) -> int:
    return 0 if context_len <= DECODE_BUCKET_MIN else (context_len - 1).bit_length()


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

    def decode_batch(self, chunks: list[int], *, all_rows: bool) -> DecodeBatch:
        contexts = [self.context_lens[i] for i in chunks]
        kv_len = max(contexts)
        tables = self.tables if all_rows else self.tables[long_tensor(chunks)]
        slots, visible = self._gather_slots(tables, contexts, kv_len)
        rows = None if all_rows else long_tensor([self.first_rows[i] for i in chunks])
        return DecodeBatch(rows, slots.view(-1), visible[:, None, None, :], len(chunks), kv_len)

    def padded_prefill(self, chunks: list[int], *, all_rows: bool) -> PaddedPrefill:
        lens = [self.query_lens[i] for i in chunks]
        starts = [self.start_positions[i] for i in chunks]
        contexts = [self.context_lens[i] for i in chunks]
        first_rows = [self.first_rows[i] for i in chunks]
        query_len, kv_len = max(lens), max(contexts)
        offsets = _arange(query_len)
        real_query = offsets < long_tensor(lens)[:, None]  # [chunks, query_len]
        query_rows = torch.where(real_query, long_tensor(first_rows)[:, None] + offsets, 0)
        key_positions = _arange(kv_len)
        query_positions = long_tensor(starts)[:, None] + offsets
        causal = key_positions <= query_positions[:, :, None]  # [chunks, query_len, kv_len]
        # A padding query sees key 0 only, so its softmax stays finite.
        mask = torch.where(real_query[:, :, None], causal, key_positions == 0)
        mask = self._fold(mask[:, None]).reshape(len(chunks), 1, -1, kv_len)
        tables = self.tables if all_rows else self.tables[long_tensor(chunks)]
        slots, _ = self._gather_slots(tables, contexts, kv_len)
        kept = None if min(lens) == query_len else torch.nonzero(real_query.view(-1)).view(-1)
        rows = None
        if not all_rows:
            ranges = (range(r, r + n) for r, n in zip(first_rows, lens, strict=True))
            rows = long_tensor(itertools.chain.from_iterable(ranges))
        return PaddedPrefill(
            rows, query_rows.view(-1), kept, slots.view(-1), mask, len(chunks), query_len, kv_len
        )

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
            slots, _ = self._gather_slots(self.tables[i : i + 1], [kv_len], kv_len)
            pieces.append(
                ChunkPrefill((first + offset, first + offset + rows), slots.view(-1), mask, kv_len)
            )
        return pieces

    def _fold(self, mask: torch.Tensor) -> torch.Tensor:
        """[chunks, 1, queries, keys] -> [chunks, group, queries, keys]: the query heads that
        share a KV head become extra query rows (see torch_attention)."""
        return mask.expand(-1, self.queries_per_kv, -1, -1)

    def _gather_slots(
        self, tables: torch.Tensor, context_lens: Sequence[int], kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of keys 0..kv_len-1 per chunk [chunks, kv_len] (the null slot past each
        context) and which of them are real."""
        block_size = self.cache.block_size
        width = -(-kv_len // block_size)
        slots = (tables[:, :width] * block_size).unsqueeze(2) + _arange(block_size)
        slots = slots.view(tables.shape[0], width * block_size)[:, :kv_len]
        visible = _arange(kv_len) < long_tensor(context_lens)[:, None]
        return torch.where(visible, slots, self.cache.null_slot), visible


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


def _to(piece: _PieceT, device: torch.device) -> _PieceT:
    """The piece with its index tensors on `device` (built on the CPU, where Python lives)."""
    if device.type == "cpu":
        return piece
    moved = {
        field.name: value.to(device, non_blocking=True)
        for field in dataclasses.fields(piece)
        if isinstance(value := getattr(piece, field.name), torch.Tensor)
    }
    return dataclasses.replace(piece, **moved)
