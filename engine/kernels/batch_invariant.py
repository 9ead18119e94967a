"""Batch-invariant kernels for deterministic mode (`--deterministic`, CPU, torch).

In the default kernels a token's logits depend, in their last bits, on what it is batched with
and on whether it is prefilled or decoded: MKL's sgemm takes other code paths for 1-3 rows, and
attention reduces a decode token's keys in another order than a prefill chunk's. Recovery
re-prefills prompt + delivered tokens where the undisturbed run decoded them, so at a near-tie a
resumed stream could pick another token. Here every reduction has one order per token:

- linear layers: at least MIN_GEMM_ROWS rows per GEMM (zero rows padded), where sgemm computes
  each row the same way whatever the row count (checked by tests/unit/test_batch_invariance.py);
- attention: each query token against its own context, the keys of every token padded with zero
  (masked) keys to the step's longest context: scores are per-(query, key) dot products over
  head_dim, and the softmax denominator and the weighted sum of values are sequential sums over
  positions (cumsum's running total), to which the padding adds exact zeros.

The cost is the padding and the copies of the context (measured by tools/bench_offline.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.kernels.attention_metadata import AttentionMetadata, long_tensor
from engine.kernels.kv_cache import PagedKVCache

MIN_GEMM_ROWS = 4  # MKL's sgemm takes another path for 1-3 rows
QUERY_TILE = 16  # query tokens attended together (bounds the [tile, heads, keys, dim] products)
KEY_PAD = 16  # contexts are padded to a multiple of this many keys (fewer distinct shapes)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.shape[0]
    if rows >= MIN_GEMM_ROWS:
        return F.linear(x, weight, bias)
    padded = x.new_zeros(MIN_GEMM_ROWS, x.shape[1])
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows]


def output_projection(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: linear(x, weight)


@dataclasses.dataclass
class InvariantAttentionMetadata(AttentionMetadata):
    """Per query token: the cache slots of its context (null slot beyond it) and its length."""

    key_slots: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))
    context_lens: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))


def build_attention_metadata(
    query_lens: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    cache: PagedKVCache,
    queries_per_kv: int,
    device: torch.device,
) -> InvariantAttentionMetadata:
    block_size = cache.block_size
    positions: list[int] = []
    slot_mapping: list[int] = []
    context_lens: list[int] = []
    longest = max(s + q for s, q in zip(start_positions, query_lens, strict=True))
    width = -(-longest // KEY_PAD) * KEY_PAD
    key_slots = torch.full((sum(query_lens), width), cache.null_slot, dtype=torch.long)
    row = 0
    for query_len, start, table in zip(query_lens, start_positions, block_tables, strict=True):
        context = start + query_len
        slots = [table[p // block_size] * block_size + p % block_size for p in range(context)]
        for position in range(start, context):
            positions.append(position)
            slot_mapping.append(slots[position])
            context_lens.append(position + 1)
            key_slots[row, : position + 1] = torch.tensor(slots[: position + 1])
            row += 1
    return InvariantAttentionMetadata(
        num_tokens=row,
        positions=long_tensor(positions).to(device),
        slot_mapping=long_tensor(slot_mapping).to(device),
        pieces=[],
        key_slots=key_slots.to(device),
        context_lens=long_tensor(context_lens).to(device),
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
    """As torch_attention.paged_attention: query [tokens, heads, head_dim], key and value
    [tokens, kv_heads, head_dim]; returns [tokens, heads * head_dim]."""
    assert isinstance(meta, InvariantAttentionMetadata)
    cache.write(layer, meta.slot_mapping, key, value)
    tokens, heads, head_dim = query.shape
    kv_heads = cache.keys[layer].shape[1]
    out = query.new_empty(tokens, heads * head_dim)
    positions = torch.arange(meta.key_slots.shape[1], device=query.device)
    for start in range(0, tokens, QUERY_TILE):
        stop = min(start + QUERY_TILE, tokens)
        slots = meta.key_slots[start:stop]
        k = cache.keys[layer][slots].permute(0, 2, 1, 3)  # [tile, kv_heads, keys, head_dim]
        v = cache.values[layer][slots].permute(0, 2, 1, 3)
        q = query[start:stop].view(stop - start, kv_heads, -1, 1, head_dim)
        scores = (q * k[:, :, None]).sum(-1) * scale  # [tile, kv_heads, group, keys]
        hidden = positions[None, :] >= meta.context_lens[start:stop, None]
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
        weights = (scores - scores.amax(-1, keepdim=True)).exp()
        total = weights.cumsum(-1)[..., -1:]
        summed = (weights[..., None] * v[:, :, None]).cumsum(-2)[..., -1, :]
        out[start:stop] = (summed / total).reshape(stop - start, heads * head_dim)
    return out
