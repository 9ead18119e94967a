"""The pool of physical KV blocks: reference counts, free lists and the prefix-cache index.

A block is in exactly one of three states:

- owned: `ref_count > 0`, held by one or more block tables;
- cached: free (`ref_count == 0`) but still holding the KV of a full block whose hash is in the
  index, so a later request with the same prefix can take it back without recomputing it;
- clean: free and holding nothing worth keeping.

Allocation takes clean blocks first and only then evicts the least recently freed cached block,
so cached prefixes survive as long as there is room for them. A pinned block (one being copied
out: the disk tier writing it, engine/scheduler/disk_tier.py) is never evicted; a pinned cached
block keeps its place among the cached, still found by lookups, but is not counted free.

With a `PrefixIndex` (engine/kv/cache/prefix_index.py) the pool mirrors its index there, and a
new pool starts from what it holds: those blocks are cached, free and evictable.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.kv.cache.prefix_index import PrefixIndex


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int, record: PrefixIndex | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if record is not None and record.num_blocks != num_blocks:
            raise ValueError(f"a prefix index of {record.num_blocks} blocks for {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Clean free blocks: a stack, so recently used memory is reused first.
        self._clean: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached free blocks in eviction order (least recently freed first).
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._pinned: set[int] = set()
        self._record = record
        if record is not None:
            self._restore(record)

    # ---- capacity ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (pinned cached blocks are not among them)."""
        pinned_cached = sum(1 for block_id in self._pinned if block_id in self._cached)
        return len(self._clean) + len(self._cached) - pinned_cached

    def counted_free(self, block_id: int) -> bool:
        """Whether `block_id` is among num_free_blocks (cached and not pinned): taking it back
        (acquire) leaves one free block fewer."""
        return block_id in self._cached and block_id not in self._pinned

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by some sequence (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- ownership -----------------------------------------------------------------------------

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (clean first, then evict cached ones), each with ref_count 1."""
        if count > self.num_free_blocks:
            raise OutOfBlocksError(
                f"asked for {count} KV blocks but only {self.num_free_blocks} are free"
            )
        blocks: list[int] = []
        for _ in range(count):
            if self._clean:
                block_id = self._clean.pop()
            else:
                block_id = next(b for b in self._cached if b not in self._pinned)
                del self._cached[block_id]
                self._forget_hash(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def acquire(self, block_id: int) -> None:
        """Add a reference to an owned or cached block (a cached one is taken off the free list)."""
        if self.ref_counts[block_id] == 0:
            if block_id not in self._cached:
                raise ValueError(f"block {block_id} is clean and free; it holds no KV to share")
            del self._cached[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in order; the last reference frees the block.

        Blocks freed later are evicted later, so callers release a table's tail first: the
        prefix blocks, the ones most likely to be shared again, then stay cached longest.
        """
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} released more often than acquired")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                if self.block_hashes[block_id] is None:
                    self._clean.append(block_id)
                else:
                    self._cached[block_id] = None

    def pin(self, block_id: int) -> None:
        """Keep an indexed block from eviction (owned or cached, it stays as it is)."""
        if self.block_hashes[block_id] is None:
            raise ValueError(f"block {block_id} holds no indexed KV; only such blocks are pinned")
        self._pinned.add(block_id)

    def unpin(self, block_id: int) -> None:
        self._pinned.discard(block_id)

    # ---- prefix-cache index --------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the KV for `block_hash`, owned or cached, if any."""
        return self.hash_to_block.get(block_hash)

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Index an owned, full block under its hash.

        If another block already holds this hash (two sequences computed the same prefix at the
        same time), the first keeps the entry and this block stays unindexed: it is freed clean
        later instead of occupying a cached slot nobody can reach. Returns whether it was indexed.
        """
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not owned; only owned blocks can be indexed")
        if self.block_hashes[block_id] is not None:
            return self.block_hashes[block_id] == block_hash
        if block_hash in self.hash_to_block:
            return False
        self.block_hashes[block_id] = block_hash
        self.hash_to_block[block_hash] = block_id
        if self._record is not None:
            self._record.put(block_id, block_hash)
        return True

    def clear_cache(self) -> None:
        """Forget every index entry (the KV memory behind them is gone, e.g. workers restarted)."""
        for block_id in range(self.num_blocks):
            self.block_hashes[block_id] = None
        self.hash_to_block.clear()
        self._clean.extend(reversed(self._cached))
        self._cached.clear()
        if self._record is not None:
            self._record.drop_all()

    def _restore(self, record: PrefixIndex) -> None:
        """Take the record's blocks as cached and free (a fresh pool: nothing is owned)."""
        restored = set()
        for block_id, block_hash in record.entries():
            if block_hash in self.hash_to_block:  # one key in two slots: the first keeps it
                record.drop(block_id)
                continue
            self.block_hashes[block_id] = block_hash
            self.hash_to_block[block_hash] = block_id
            self._cached[block_id] = None
            restored.add(block_id)
        self._clean = [block_id for block_id in self._clean if block_id not in restored]

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is None:
            return
        self.block_hashes[block_id] = None
        if self._record is not None:  # before the block is handed out for other KV
            self._record.drop(block_id)
        # Only the block that owns the entry may remove it.
        if self.hash_to_block.get(block_hash) == block_id:
            del self.hash_to_block[block_hash]

    # ---- checks --------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests)."""
        clean = set(self._clean)
        cached = set(self._cached)
        assert len(clean) == len(self._clean), "a block is on the clean list twice"
        assert not clean & cached, "a block is both clean and cached"
        for block_id in self._pinned:
            assert self.block_hashes[block_id] is not None, f"pinned block {block_id} has no hash"
        for block_id, count in enumerate(self.ref_counts):
            assert count >= 0, f"block {block_id} has ref_count {count}"
            free = block_id in clean or block_id in cached
            assert free == (count == 0), f"block {block_id}: ref_count {count}, free={free}"
            block_hash = self.block_hashes[block_id]
            if block_id in cached:
                assert block_hash is not None, f"cached block {block_id} has no hash"
            if block_id in clean:
                assert block_hash is None, f"clean block {block_id} still has a hash"
            if block_hash is not None:
                owner = self.hash_to_block.get(block_hash)
                assert owner == block_id, f"block {block_id}'s hash is indexed to {owner}"
        for block_hash, block_id in self.hash_to_block.items():
            assert self.block_hashes[block_id] == block_hash, f"index entry -> block {block_id}"
