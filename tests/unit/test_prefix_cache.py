from __future__ import annotations

import pytest

from engine.kv.cache.block_manager import BlockManager
from engine.kv.cache.block_table import BlockTable
from engine.kv.cache.prefix_cache import BlockHashChain, PrefixCacheStats, hash_block


def _computed_table(kv: BlockManager, token_ids: list[int]) -> BlockTable:
    """A sequence whose tokens all went through the model."""
    table = BlockTable()
    assert kv.admit(table, [], len(token_ids))
    kv.commit(table, BlockHashChain(kv.block_size), token_ids, len(token_ids))
    return table


def test_a_block_key_names_the_whole_prefix_not_just_its_tokens() -> None:
    first = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == first
    assert hash_block(first, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    chain = BlockHashChain(2)
    assert chain.first([1, 2, 3, 4, 5], 2) == [first, hash_block(first, [3, 4])]


def test_a_partial_block_has_no_key() -> None:
    with pytest.raises(ValueError, match="not full"):
        BlockHashChain(4).key([1, 2, 3], 0)


def test_a_new_sequence_reuses_the_computed_full_blocks_of_a_shared_prefix() -> None:
    kv = BlockManager(8, 4, enable_prefix_caching=True)
    first = _computed_table(kv, list(range(10)))  # blocks [0..3] [4..7] + partial [8, 9]
    other = [0, 1, 2, 3, 4, 5, 6, 7, 42, 43, 44]
    hits = kv.cached_prefix(BlockHashChain(4), other)
    assert hits == first.block_ids[:2]
    diverging = [0, 1, 2, 3, 99, 5, 6, 7, 8]
    assert kv.cached_prefix(BlockHashChain(4), diverging) == first.block_ids[:1]


def test_a_full_prefix_hit_still_leaves_the_last_token_to_compute() -> None:
    kv = BlockManager(8, 4, enable_prefix_caching=True)
    first = _computed_table(kv, list(range(8)))
    hits = kv.cached_prefix(BlockHashChain(4), list(range(8)))
    assert hits == first.block_ids[:1]  # tokens 4..7 are recomputed into a block of its own
    table = BlockTable()
    assert kv.admit(table, hits, 8)
    assert table.block_ids[0] == first.block_ids[0]
    assert table.block_ids[1] != first.block_ids[1]


def test_freed_prefix_blocks_are_hit_until_evicted() -> None:
    kv = BlockManager(4, 2, enable_prefix_caching=True)
    table = _computed_table(kv, [5, 6, 7, 8, 9])
    kept = table.block_ids[:2]
    kv.free(table)
    assert kv.num_free_blocks == 4
    assert kv.cached_prefix(BlockHashChain(2), [5, 6, 7, 8, 1]) == kept
    filler = BlockTable()
    assert kv.admit(filler, [], 8)  # needs every block: the cached ones are evicted
    assert kv.cached_prefix(BlockHashChain(2), [5, 6, 7, 8, 1]) == []


def test_blocks_freed_tail_first_keep_the_prefix_head_cached_longest() -> None:
    kv = BlockManager(4, 2, enable_prefix_caching=True)
    table = _computed_table(kv, [1, 2, 3, 4, 5, 6, 7])
    head = table.block_ids[0]
    kv.free(table)
    filler = BlockTable()
    assert kv.admit(filler, [], 6)  # three blocks: one clean, two evicted from the tail end
    assert kv.cached_prefix(BlockHashChain(2), [1, 2, 3]) == [head]


def test_taking_back_a_cached_block_counts_against_free_blocks() -> None:
    kv = BlockManager(2, 2, enable_prefix_caching=True)
    table = _computed_table(kv, [1, 2, 3, 4])
    kv.free(table)
    hits = kv.cached_prefix(BlockHashChain(2), [1, 2, 3, 4, 5])
    assert len(hits) == 2
    # 2 revived + 1 new > 2 blocks: refused, nothing changed.
    assert not kv.admit(BlockTable(), hits, 5)
    assert kv.num_free_blocks == 2
    kv.pool.check_invariants()


def test_without_prefix_caching_nothing_is_indexed_or_hit() -> None:
    kv = BlockManager(8, 2, enable_prefix_caching=False)
    table = _computed_table(kv, [1, 2, 3, 4, 5])
    assert table.num_committed_blocks == 2
    assert kv.pool.hash_to_block == {}
    assert kv.cached_prefix(BlockHashChain(2), [1, 2, 3, 4, 5]) == []


def test_hit_rate_is_hit_tokens_over_queried_tokens() -> None:
    stats = PrefixCacheStats()
    assert stats.hit_rate == 0.0
    stats.record(10, 8)
    stats.record(30, 0)
    assert stats.hit_rate == pytest.approx(8 / 40)
