"""Sliding-window and soft-capped attention (Mistral, Gemma 2, ...) in every CPU kernel backend
against the formula written out per token: a token sees itself and the window - 1 keys before
it, and each score s becomes cap * tanh(s / cap) before the softmax. The contexts reach past
the compiled kernel's 256-key parts, windows cut through blocks, prefill chunks both start a
sequence and follow cached keys."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.kernels import attention_metadata, batch_invariant, torch_attention
from engine.kernels.cpu import attention as cpu_attention
from engine.kernels.kv_cache import PagedKVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK, SCALE = 4, 2, 64, 16, 0.125
BACKENDS = {
    "torch": (torch_attention.paged_attention, attention_metadata.build_attention_metadata),
    "cpu": (
        cpu_attention.paged_attention,
        functools.partial(attention_metadata.build_attention_metadata, in_place="table"),
    ),
    "batch_invariant": (batch_invariant.paged_attention, batch_invariant.build_attention_metadata),
}
# (window, softcap, query lengths, start positions): decodes deep in long contexts, short and
# long chunks from position 0 and after cached keys.
CASES = [
    (7, None, [1, 1, 5, 40], [30, 300, 10, 0]),
    (20, 30.0, [1, 3, 40, 50], [300, 5, 0, 20]),
    (None, 5.0, [1, 1, 40], [3, 600, 0]),
    (300, None, [1, 2], [620, 400]),
]


def expected(q, keys, values, lens, starts, window, softcap):  # type: ignore[no-untyped-def]
    group = HEADS // KV_HEADS
    rows = []
    for seq, (count, start) in enumerate(zip(lens, starts, strict=True)):
        k = keys[seq].repeat_interleave(group, 1)
        v = values[seq].repeat_interleave(group, 1)
        for position in range(start, start + count):
            scores = torch.einsum("hd,khd->hk", q[len(rows)], k[: position + 1]) * SCALE
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if window is not None:
                scores[:, : max(0, position + 1 - window)] = float("-inf")
            rows.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[: position + 1]))
    return torch.stack(rows).reshape(len(rows), -1)


@pytest.mark.parametrize(("window", "softcap", "lens", "starts"), CASES)
def test_windowed_and_capped_attention_equals_the_formula(
    window: int | None, softcap: float | None, lens: list[int], starts: list[int]
) -> None:
    generator = torch.Generator().manual_seed(len(lens) + (window or 0))
    cache = PagedKVCache(
        num_layers=1,
        num_blocks=80 * len(lens),
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    tables = [list(range(80 * (i + 1) - 1, 80 * i - 1, -1)) for i in range(len(lens))]
    totals = [s + n for s, n in zip(starts, lens, strict=True)]
    keys = [torch.randn(t, KV_HEADS, HEAD_DIM, generator=generator) for t in totals]
    values = [torch.randn(t, KV_HEADS, HEAD_DIM, generator=generator) for t in totals]
    for seq, table in enumerate(tables):  # the cached context, as earlier steps wrote it
        cached = range(starts[seq])
        slots = torch.tensor(
            [table[p // BLOCK] * BLOCK + p % BLOCK for p in cached], dtype=torch.long
        )
        cache.write(0, slots, keys[seq][: starts[seq]], values[seq][: starts[seq]])
    q = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=generator)
    new_k = torch.cat([keys[i][starts[i] :] for i in range(len(lens))])
    new_v = torch.cat([values[i][starts[i] :] for i in range(len(lens))])
    reference = expected(q, keys, values, lens, starts, window, softcap)
    for name, (attend, build) in BACKENDS.items():
        meta = build(
            lens, starts, tables, cache=cache, queries_per_kv=HEADS // KV_HEADS, device=q.device
        )
        out = attend(q, new_k, new_v, cache, 0, meta, SCALE, window, softcap)
        torch.testing.assert_close(out, reference, rtol=0, atol=2e-6, msg=name)
