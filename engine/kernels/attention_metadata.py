"""Per-step index tensors for the torch paged-attention backend, built once and shared by every
layer.

A step's chunks split into two groups: decode (one token per chunk) and prefill (longer
chunks). For each group the builder lists which cache slots to gather into a padded batch and
which of them each query may see. Padding gathers the cache's zero slot, so nothing that was
never written is read. Work is done in Python where it is per chunk and in torch where it is
per token or per key, so a decode step of many sequences costs a handful of tensor ops.
"""

from __future__ import annotations

import dataclasses
import itertools
from array import array
from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch

from engine.kernels.kv_cache import PagedKVCache


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
    mask: torch.Tensor | None  # [chunks, 1, group * query_len, kv_len], True = attend
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


_BatchT = TypeVar("_BatchT", DecodeBatch | None, PrefillBatch | None)
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
    decode_chunks = [i for i, n in enumerate(query_lens) if n == 1]
    prefill_chunks = [i for i, n in enumerate(query_lens) if n > 1]

    if prefill_chunks:
        lens = long_tensor(query_lens)
        token_chunk = torch.repeat_interleave(_arange(len(query_lens)), lens)
        offsets = long_tensor([s - r for s, r in zip(start_positions, first_rows, strict=True)])
        positions = offsets[token_chunk] + _arange(num_tokens)
        slot_mapping = tables[token_chunk, positions // block_size] * block_size + (
            positions % block_size
        )
    else:  # one token per chunk: plain Python is cheaper than tensor ops
        positions = long_tensor(start_positions)
        slot_mapping = long_tensor(
            [
                table[p // block_size] * block_size + p % block_size
                for table, p in zip(block_tables, start_positions, strict=True)
            ]
        )

    decode = None
    if decode_chunks:
        everything = not prefill_chunks
        decode = _decode_batch(
            None if everything else long_tensor([first_rows[i] for i in decode_chunks]),
            tables if everything else tables[long_tensor(decode_chunks)],
            [context_lens[i] for i in decode_chunks],
            cache.null_slot,
            block_size,
        )
    prefill = None
    if prefill_chunks:
        rows = None
        if decode_chunks:
            rows = long_tensor(
                itertools.chain.from_iterable(
                    range(first_rows[i], first_rows[i] + query_lens[i]) for i in prefill_chunks
                )
            )
        prefill = _prefill_batch(
            rows,
            [first_rows[i] for i in prefill_chunks],
            [query_lens[i] for i in prefill_chunks],
            [start_positions[i] for i in prefill_chunks],
            tables[long_tensor(prefill_chunks)] if decode_chunks else tables,
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


def long_tensor(values: Iterable[int]) -> torch.Tensor:
    """An int64 CPU tensor of Python ints, via array (several times faster than torch.tensor)."""
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _arange(n: int) -> torch.Tensor:
    """0..n-1 without allocating each step (a view of one cached arange)."""
    global _arange_cache
    if n > _arange_cache.numel():
        _arange_cache = torch.arange(max(n, 2 * _arange_cache.numel()))
    return _arange_cache[:n]


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


def _gather_slots(
    tables: torch.Tensor, context_lens: Sequence[int], kv_len: int, null_slot: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of keys 0..kv_len-1 per chunk [chunks, kv_len] (null slot past each context) and
    which of them are real."""
    width = -(-kv_len // block_size)
    slots = (tables[:, :width] * block_size).unsqueeze(2) + _arange(block_size)
    slots = slots.view(tables.shape[0], width * block_size)[:, :kv_len]
    visible = _arange(kv_len) < long_tensor(context_lens)[:, None]
    return torch.where(visible, slots, null_slot), visible


def _decode_batch(
    rows: torch.Tensor | None,
    tables: torch.Tensor,
    context_lens: Sequence[int],
    null_slot: int,
    block_size: int,
) -> DecodeBatch:
    kv_len = max(context_lens)
    slots, visible = _gather_slots(tables, context_lens, kv_len, null_slot, block_size)
    return DecodeBatch(rows, slots.view(-1), visible[:, None, None, :], len(context_lens), kv_len)


def _prefill_batch(
    rows: torch.Tensor | None,
    first_rows: list[int],
    query_lens: list[int],
    start_positions: list[int],
    tables: torch.Tensor,
    *,
    queries_per_kv: int,
    null_slot: int,
    block_size: int,
) -> PrefillBatch:
    chunks = len(query_lens)
    query_len = max(query_lens)
    context_lens = [s + n for s, n in zip(start_positions, query_lens, strict=True)]
    kv_len = max(context_lens)
    if chunks == 1 and start_positions[0] == 0:  # nothing cached: causal over its own K/V
        query_rows = _arange(first_rows[0] + query_len)[first_rows[0] :]
        return PrefillBatch(rows, query_rows, None, None, None, 1, query_len, query_len)

    offsets = _arange(query_len)
    real_query = offsets < long_tensor(query_lens)[:, None]  # [chunks, query_len]
    query_rows = torch.where(real_query, long_tensor(first_rows)[:, None] + offsets, 0)
    key_positions = _arange(kv_len)
    query_positions = long_tensor(start_positions)[:, None] + offsets
    causal = key_positions <= query_positions[:, :, None]  # [chunks, query_len, kv_len]
    mask = torch.where(real_query[:, :, None], causal, key_positions == 0)  # padding: key 0 only
    # Queries that share a KV head are folded into the query axis (see torch_attention).
    mask = mask[:, None].expand(-1, queries_per_kv, -1, -1)
    mask = mask.reshape(chunks, 1, queries_per_kv * query_len, kv_len)
    kv_slots, _ = _gather_slots(tables, context_lens, kv_len, null_slot, block_size)
    kept = None
    if min(query_lens) < query_len:
        kept = torch.nonzero(real_query.view(-1)).view(-1)
    return PrefillBatch(
        rows, query_rows.view(-1), kept, kv_slots.view(-1), mask, chunks, query_len, kv_len
    )


def _to(batch: _BatchT, device: torch.device) -> _BatchT:
    """The batch with its index tensors on `device` (built on the CPU, where Python lives)."""
    if batch is None or device.type == "cpu":
        return batch
    moved = {
        field.name: value.to(device, non_blocking=True)
        for field in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, field.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)
