"""A rank's cache seen as bytes: block copies, coalesced runs, and the socket stream, checked
against a per-block numpy reference built here from the cache's documented shape."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kv.transfer.cache_view import (
    CacheView,
    copy_blocks,
    gather,
    paired_runs,
    runs,
    scatter,
)
from engine.messages.kv_transfer import KvLayout

LAYERS, HEADS, HEAD_DIM, BLOCK = 3, 2, 4, 4


def layout(num_blocks: int, **changes: object) -> KvLayout:
    fields: dict[str, object] = {
        "model": "TestForCausalLM/L3",
        "num_layers": LAYERS,
        "num_kv_heads": HEADS,
        "head_dim": HEAD_DIM,
        "block_size": BLOCK,
        "dtype": "float32",
        "itemsize": 4,
        "tp_size": 1,
        "tp_rank": 0,
        "num_blocks": num_blocks,
        **changes,
    }
    return KvLayout(**fields)  # type: ignore[arg-type]


def cache(num_blocks: int, seed: int) -> np.ndarray:
    """A cache as the worker holds it: [layers, 2, num_slots + 1, heads, head_dim]."""
    shape = (LAYERS, 2, num_blocks * BLOCK + 1, HEADS, HEAD_DIM)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def block(array: np.ndarray, layer: int, kv: int, block_id: int) -> np.ndarray:
    return array[layer, kv, block_id * BLOCK : (block_id + 1) * BLOCK]


def test_copy_blocks_moves_each_named_block_and_nothing_else() -> None:
    src, dst = cache(8, seed=1), cache(10, seed=2)
    src_ids, dst_ids = [2, 3, 4, 7, 0], [5, 6, 7, 1, 9]
    expected = dst.copy()
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected[:, :, d * BLOCK : (d + 1) * BLOCK] = src[:, :, s * BLOCK : (s + 1) * BLOCK]

    copied = copy_blocks(CacheView(layout(8), src), CacheView(layout(10), dst), src_ids, dst_ids)

    assert np.array_equal(dst, expected)
    assert copied == len(src_ids) * LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4


def test_runs_of_consecutive_ids_are_coalesced_on_both_sides() -> None:
    assert runs([4, 5, 6, 9, 10, 2]) == [(4, 3), (9, 2), (2, 1)]
    assert paired_runs([3, 4, 5, 9], [10, 11, 2, 3]) == [(3, 10, 2), (5, 2, 1), (9, 3, 1)]
    view = CacheView(layout(8), cache(8, seed=3))
    chunks = view.chunks([0, 1, 2, 7])
    assert len(chunks) == LAYERS * 2 * 2  # two runs per layer's K and V
    assert [len(c) for c in chunks[:2]] == [3 * view.layout.chunk_bytes, view.layout.chunk_bytes]


def test_the_stream_is_each_layers_k_then_v_of_the_blocks_in_order() -> None:
    src = cache(8, seed=4)
    ids = [5, 1, 2, 6]
    expected = b"".join(
        block(src, layer, kv, b).tobytes() for layer in range(LAYERS) for kv in (0, 1) for b in ids
    )
    assert gather(CacheView(layout(8), src), ids) == expected


def test_a_scattered_stream_lands_in_the_destination_blocks() -> None:
    src, dst = cache(8, seed=5), cache(6, seed=6)
    src_ids, dst_ids = [7, 0, 1], [3, 4, 0]
    expected = dst.copy()
    for s, d in zip(src_ids, dst_ids, strict=True):
        for layer in range(LAYERS):
            for kv in (0, 1):
                block(expected, layer, kv, d)[:] = block(src, layer, kv, s)

    scatter(CacheView(layout(6), dst), dst_ids, gather(CacheView(layout(8), src), src_ids))

    assert np.array_equal(dst, expected)


def test_ids_outside_the_cache_and_other_layouts_are_refused() -> None:
    src, dst = CacheView(layout(4), cache(4, seed=7)), CacheView(layout(4), cache(4, seed=8))
    with pytest.raises(ValueError, match="source block id 4 is not a block of this cache"):
        copy_blocks(src, dst, [4], [0])
    with pytest.raises(ValueError, match="destination block id -1"):
        copy_blocks(src, dst, [0], [-1])
    with pytest.raises(ValueError, match="2 source block ids but 1 destination ids"):
        copy_blocks(src, dst, [0, 1], [0])
    other = CacheView(layout(4, head_dim=2, num_kv_heads=4), cache(4, seed=9))
    with pytest.raises(ValueError, match="num_kv_heads is 2 here but 4 at the peer"):
        copy_blocks(other, dst, [0], [0])
    with pytest.raises(ValueError, match=r"takes .* bytes, but its buffer has 16"):
        CacheView(layout(4), bytearray(16))


def test_int8_blocks_travel_with_their_scales() -> None:
    """An int8 cache's rows carry their scales (engine/kernels/kv_cache.py): its layout's bytes
    are exactly the cache's, and a copied block reads back the same values at the destination."""
    import torch

    from engine.kernels.kv_cache import PagedKVCache

    def int8_cache(num_blocks: int) -> tuple[PagedKVCache, CacheView]:
        int8 = layout(num_blocks, dtype="int8", itemsize=1, scale_bytes=4)
        buffer = bytearray(int8.segment_bytes)  # PagedKVCache refuses a buffer of another size
        cache = PagedKVCache(
            num_layers=LAYERS,
            num_blocks=num_blocks,
            block_size=BLOCK,
            num_kv_heads=HEADS,
            head_dim=HEAD_DIM,
            dtype=torch.int8,
            device=torch.device("cpu"),
            buffer=buffer,
        )
        return cache, CacheView(int8, buffer)

    (src, src_view), (dst, dst_view) = int8_cache(8), int8_cache(10)
    slots = torch.arange(2 * BLOCK, 4 * BLOCK)  # blocks 2 and 3
    for layer in range(LAYERS):
        rows = torch.randn(2 * BLOCK, HEADS, HEAD_DIM) * (layer + 1)
        src.write(layer, slots, rows, -rows)
    copy_blocks(src_view, dst_view, [2, 3], [7, 0])
    moved = torch.cat((torch.arange(7 * BLOCK, 8 * BLOCK), torch.arange(0, BLOCK)))
    for layer in range(LAYERS):
        sent, arrived = (
            src.gather(layer, slots, torch.float32),
            dst.gather(layer, moved, torch.float32),
        )
        assert torch.equal(sent[0], arrived[0]) and torch.equal(sent[1], arrived[1])
