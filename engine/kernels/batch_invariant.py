"""Batch-invariant kernels for deterministic mode (`--deterministic`, CPU, torch).

In the default kernels a token's logits depend, in their last bits, on what it is batched with
and on whether it is prefilled or decoded: MKL's sgemm takes other code paths for 1-3 rows, and
attention reduces a decode token's keys in another order than a prefill chunk's. Recovery
re-prefills prompt + delivered tokens where the undisturbed run decoded them, so at a near-tie a
resumed stream could pick another token. Here every reduction has one order per token:

- linear layers and the vocabulary projection: the compiled CPU kernels (engine/kernels/cpu/
  linear.cpp, bf16_linear.cpp for bfloat16 weights), whose sum over k runs in one order for every
  row whatever the rows beside it, the thread count (and, for bfloat16, the CPU's path).
  MKL's sgemm promises no such thing: it changes kernels with the row count at thresholds that
  depend on the CPU and the weight's width (on an AVX-512 Xeon, between 5 and 6 rows for a
  128-wide weight, 15 and 16 for a 576-wide one; on the AVX2 EPYC the team measured,
  below 4 rows). Where the kernel cannot be built, or a weight is not packed for it, sgemm runs
  with at least MIN_GEMM_ROWS rows (zero rows padded), and the vocabulary projection on oneDNN's
  packed matmul once checked to be row-invariant: invariant on the CPUs where those hold;
- attention: each query token against its own context, the keys of every token padded with zero
  (masked) keys to the step's longest context: scores are per-(query, key) dot products over
  head_dim, and the softmax denominator and the weighted sum of values are sums over positions
  in an order that the padding cannot change (see _sum_over_keys).

The cost is the padding and the copies of the context (tools/bench/offline.py shows it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.kernels.attention_metadata import AttentionMetadata, long_tensor
from engine.kernels.backend import Linear
from engine.kernels.cpu import backend as cpu_backend
from engine.kernels.cpu.bf16_linear import Bf16Panels, bf16_panels
from engine.kernels.cpu.linear import Bf16Linear, PanelLinear, Panels, panel_linear
from engine.kernels.kv_cache import PagedKVCache
from engine.kernels.torch_ops import packed_linear

MIN_GEMM_ROWS = 4  # MKL's sgemm takes another path for 1-3 rows
TILE_ELEMENTS = 1 << 19  # bounds the [tokens, heads, keys, head_dim] products of one tile
KEY_PAD = 16  # contexts are padded to a multiple of this many keys (fewer distinct shapes)
PROBE_ROWS = 20  # row counts 1..PROBE_ROWS tried before trusting a matmul to be row-invariant


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.shape[0]
    if rows >= MIN_GEMM_ROWS:
        return F.linear(x, weight, bias)
    padded = x.new_zeros(MIN_GEMM_ROWS, x.shape[1])
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows]


def linear_for(weight: torch.Tensor) -> Linear:
    """A decoder weight's linear: the compiled kernel's where it runs (bfloat16's at every row
    count, never oneDNN's), else the padded sgemm."""
    panels = _panels(weight)
    if isinstance(panels, Bf16Panels):
        return Bf16Linear(weight, panels, None)
    return linear if panels is None else PanelLinear(weight, panels)


def output_projection(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The vocabulary projection: the compiled kernel's where it runs; else oneDNN's packed
    matmul where it computes a row alike for any row count (checked here, on this CPU): the
    widest matmul, which a decode step of one row would otherwise pad to MIN_GEMM_ROWS rows, and
    whose pre-packed weight saves sgemm's packing on every call; else `linear`."""
    panels = _panels(weight)
    if isinstance(panels, Bf16Panels):
        return lambda x: panels(x, None, torch.float32)
    if panels is not None:
        return lambda x: panels(x, None)
    packed = packed_linear(weight)
    if packed is not None and _row_invariant(packed, weight.shape[1], weight.dtype):
        return packed
    return lambda x: linear(x, weight)


def _panels(weight: torch.Tensor) -> Panels | Bf16Panels | None:
    """`weight` packed for the compiled kernels (float32 or bfloat16), when they load and take
    it."""
    if cpu_backend.unavailable_reason(weight.device) is not None:
        return None
    return panel_linear(weight) or bf16_panels(weight)


def _row_invariant(
    project: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype
) -> bool:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(PROBE_ROWS, width, generator=generator).to(dtype)
    alone = project(rows[:1])[0]
    return all(torch.equal(project(rows[:n])[0], alone) for n in range(2, PROBE_ROWS + 1))


@dataclasses.dataclass
class InvariantAttentionMetadata(AttentionMetadata):
    """Per query token: the cache slots of its context (null slot beyond it); a token at
    position p sees positions 0..p."""

    key_slots: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))


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
    positions: list[torch.Tensor] = []
    slot_mapping: list[torch.Tensor] = []
    key_slots: list[torch.Tensor] = []
    longest = max(s + q for s, q in zip(start_positions, query_lens, strict=True))
    columns = torch.arange(-(-longest // KEY_PAD) * KEY_PAD)
    for query_len, start, table in zip(query_lens, start_positions, block_tables, strict=True):
        blocks = long_tensor(table)[columns.clamp(max=start + query_len - 1) // block_size]
        slots = blocks * block_size + columns % block_size  # this sequence's, position by position
        chunk_positions = columns[start : start + query_len]
        positions.append(chunk_positions)
        slot_mapping.append(slots[start : start + query_len])
        # Row i sees positions <= its own; the rest read the always-zero null slot.
        visible = columns[None, :] <= chunk_positions[:, None]
        key_slots.append(torch.where(visible, slots[None, :], cache.null_slot))
    all_positions = torch.cat(positions)
    return InvariantAttentionMetadata(
        num_tokens=len(all_positions),
        positions=all_positions.to(device),
        slot_mapping=torch.cat(slot_mapping).to(device),
        pieces=[],
        key_slots=torch.cat(key_slots).to(device),
    )


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
    """As torch_attention.paged_attention: query [tokens, heads, head_dim], key and value
    [tokens, kv_heads, head_dim]; returns [tokens, heads * head_dim]."""
    assert isinstance(meta, InvariantAttentionMetadata)
    cache.write(layer, meta.slot_mapping, key, value)
    tokens, heads, head_dim = query.shape
    kv_heads = cache.num_kv_heads
    out = query.new_empty(tokens, heads * head_dim)
    keys = meta.key_slots.shape[1]
    positions = torch.arange(keys, device=query.device)
    tile = max(1, TILE_ELEMENTS // (heads * keys * head_dim))  # tokens attended together
    for start in range(0, tokens, tile):
        stop = min(start + tile, tokens)
        slots = meta.key_slots[start:stop]
        k, v = cache.gather(layer, slots, query.dtype)  # [tile, keys, kv_heads, head_dim]
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        q = query[start:stop].view(stop - start, kv_heads, -1, 1, head_dim)
        scores = (q * k[:, :, None]).sum(-1) * scale  # [tile, kv_heads, group, keys]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        hidden = positions[None, :] > meta.positions[start:stop, None]
        if window is not None:
            hidden |= positions[None, :] <= meta.positions[start:stop, None] - window
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
        weights = (scores - scores.amax(-1, keepdim=True)).exp()  # [tile, kv_heads, group, keys]
        total = _sum_over_keys(weights)[..., None]
        values_by_key = v.transpose(-1, -2).contiguous()  # [tile, kv_heads, head_dim, keys]
        summed = _sum_over_keys(weights[:, :, :, None, :] * values_by_key[:, :, None])
        out[start:stop] = (summed / total).reshape(stop - start, heads * head_dim)
    return out


def _sum_over_keys(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (keys, a multiple of KEY_PAD) in an order that padding cannot change:
    each KEY_PAD keys summed alike (a reduction of fixed length), then the partial sums added one
    after the other (cumsum's running total), to which the all-padding tail adds exact zeros.

    The keys must be adjacent in memory: over a strided dim torch picks its reduction order by the
    whole tensor's shape, so the step's longest context (the padding) would change the sums."""
    partial = x.contiguous().view(*x.shape[:-1], -1, KEY_PAD).sum(-1)
    return partial.cumsum(-1)[..., -1]
