from __future__ import annotations

import pytest

from engine.kv.cache.block_pool import BlockPool, OutOfBlocksError


def test_allocate_takes_free_blocks_and_release_returns_them() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.release(blocks)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    pool.check_invariants()


def test_asking_for_more_blocks_than_are_free_names_both_numbers() -> None:
    pool = BlockPool(2)
    with pytest.raises(OutOfBlocksError, match="asked for 3 KV blocks but only 2 are free"):
        pool.allocate(3)


def test_a_shared_block_is_freed_by_its_last_reference_only() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.acquire(block)
    pool.release([block])
    assert pool.ref_counts[block] == 1
    assert pool.num_free_blocks == 1
    pool.release([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError, match="released more often than acquired"):
        pool.release([block])


def test_a_freed_block_with_a_hash_stays_reusable_until_evicted() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    assert pool.register(block, b"prefix")
    pool.release([block])
    assert pool.num_free_blocks == 2
    assert pool.num_cached_free_blocks == 1
    assert pool.lookup(b"prefix") == block
    pool.acquire(block)  # taken back without recomputing
    assert pool.num_free_blocks == 1
    assert pool.ref_counts[block] == 1
    pool.check_invariants()


def test_clean_blocks_are_allocated_before_cached_ones_are_evicted() -> None:
    pool = BlockPool(3)
    cached = pool.allocate(1)[0]
    pool.register(cached, b"keep-me")
    pool.release([cached])
    fresh = pool.allocate(2)
    assert cached not in fresh
    assert pool.lookup(b"keep-me") == cached
    evicted = pool.allocate(1)[0]
    assert evicted == cached
    assert pool.lookup(b"keep-me") is None
    assert pool.block_hashes[cached] is None
    pool.check_invariants()


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for block, key in zip(blocks, [b"a", b"b", b"c"], strict=True):
        pool.register(block, key)
    pool.release([blocks[1], blocks[2], blocks[0]])
    assert pool.allocate(1) == [blocks[1]]
    assert pool.allocate(1) == [blocks[2]]
    assert pool.lookup(b"a") == blocks[0]


def test_a_second_block_with_the_same_hash_leaves_the_entry_with_its_owner() -> None:
    pool = BlockPool(3)
    first, second = pool.allocate(2)
    assert pool.register(first, b"same")
    assert not pool.register(second, b"same")
    pool.release([second])  # not indexed: freed clean, evicting nothing of the first's
    assert pool.num_cached_free_blocks == 0
    assert pool.lookup(b"same") == first
    pool.release([first])
    pool.allocate(3)  # evicts `first`, which owns the entry, so the entry goes with it
    assert pool.lookup(b"same") is None
    pool.check_invariants()


def test_clearing_the_cache_forgets_every_entry_and_frees_cached_blocks_clean() -> None:
    pool = BlockPool(2)
    owned, cached = pool.allocate(2)
    pool.register(owned, b"x")
    pool.register(cached, b"y")
    pool.release([cached])
    pool.clear_cache()
    assert pool.lookup(b"x") is None
    assert pool.lookup(b"y") is None
    assert pool.num_cached_free_blocks == 0
    pool.release([owned])
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_sharing_a_clean_free_block_is_refused() -> None:
    pool = BlockPool(1)
    with pytest.raises(ValueError, match="clean and free"):
        pool.acquire(0)


def test_a_pinned_block_is_never_evicted_and_keeps_its_place_among_the_cached() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for block_id, key in zip(blocks, (b"a", b"b", b"c"), strict=True):
        pool.register(block_id, key)
    pool.pin(blocks[0])  # the least recently freed: next to go but for the pin
    pool.release(blocks)
    assert pool.num_free_blocks == 2 and not pool.counted_free(blocks[0])
    assert pool.lookup(b"a") == blocks[0]  # still found, and may be shared
    assert pool.allocate(1) == [blocks[1]]
    pool.unpin(blocks[0])
    assert pool.allocate(1) == [blocks[0]]  # first in line again, not moved to the back
    pool.check_invariants()
