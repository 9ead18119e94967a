"""Which KV blocks each sequence uses: allocation, sharing of computed prefixes, prefix caching.

The scheduler's only window onto the KV cache. It never writes KV itself; it hands block ids to
the workers in each step's plan. Blocks are shared only when full and computed (committed), so
no block is ever written by one sequence while another reads it, and no copy-on-write is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv.cache.block_pool import BlockPool
from engine.kv.cache.block_table import BlockTable
from engine.kv.cache.prefix_cache import BlockHashChain, PrefixCacheStats
from engine.kv.cache.prefix_index import PrefixIndex


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        record: PrefixIndex | None = None,
    ) -> None:
        """`record`: where the prefix cache's index is mirrored, and restored from (a restarted
        scheduler's view of the KV its predecessor left in the workers' cache)."""
        if block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.pool = BlockPool(num_blocks, record if enable_prefix_caching else None)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, chain: BlockHashChain, token_ids: Sequence[int]) -> list[int]:
        """Blocks that already hold the longest cached prefix of `token_ids`.

        At most (len - 1) tokens are taken from the cache: the last token must still run through
        the model to produce the logits the next token is sampled from. No references are taken
        and nothing is counted: the caller records the lookup in `prefix_stats` once it is used.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        max_blocks = (len(token_ids) - 1) // self.block_size
        for index in range(max_blocks):
            block_id = self.pool.lookup(chain.key(token_ids, index))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def admit(self, table: BlockTable, prefix_block_ids: list[int], num_tokens: int) -> bool:
        """Start an empty table: share the computed `prefix_block_ids`, allocate up to `num_tokens`.

        Returns False and changes nothing when the pool cannot supply the blocks.
        """
        if table.block_ids:
            raise ValueError(f"admit needs an empty block table, got {table!r}")
        if not self.can_admit(prefix_block_ids, num_tokens):
            return False
        num_new = self.blocks_for(num_tokens) - len(prefix_block_ids)
        for block_id in prefix_block_ids:
            self.pool.acquire(block_id)
        table.block_ids = [*prefix_block_ids, *self.pool.allocate(num_new)]
        table.num_committed_blocks = len(prefix_block_ids)
        return True

    def can_admit(self, prefix_block_ids: list[int], num_tokens: int) -> bool:
        """Whether `admit` would find the blocks for a table of `num_tokens` that starts from
        the computed `prefix_block_ids`."""
        num_new = self.blocks_for(num_tokens) - len(prefix_block_ids)
        if num_new < 0:
            raise ValueError(
                f"{len(prefix_block_ids)} prefix blocks exceed the {num_tokens} tokens to cover"
            )
        # A cached free block leaves the free list when it is taken back.
        revived = sum(1 for block_id in prefix_block_ids if self.pool.counted_free(block_id))
        return num_new + revived <= self.pool.num_free_blocks

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Extend `table` to cover `num_tokens`; False (nothing changed) if blocks are short."""
        num_new = self.blocks_for(num_tokens) - len(table.block_ids)
        if num_new <= 0:
            return True
        if num_new > self.pool.num_free_blocks:
            return False
        table.block_ids.extend(self.pool.allocate(num_new))
        return True

    def commit(
        self,
        table: BlockTable,
        chain: BlockHashChain,
        token_ids: Sequence[int],
        num_computed_tokens: int,
    ) -> list[tuple[int, bytes]]:
        """Record that `num_computed_tokens` of the sequence now have KV; index the full blocks.
        Returns the blocks this indexed, with their keys."""
        num_full = min(num_computed_tokens // self.block_size, len(table.block_ids))
        indexed: list[tuple[int, bytes]] = []
        if num_full <= table.num_committed_blocks:
            return indexed
        if self.enable_prefix_caching:
            keys = chain.first(token_ids, num_full)
            for index in range(table.num_committed_blocks, num_full):
                block_id = table.block_ids[index]
                if self.pool.register(block_id, keys[index]):
                    indexed.append((block_id, keys[index]))
        table.num_committed_blocks = num_full
        return indexed

    def release_before(self, table: BlockTable, first_position: int) -> None:
        """Release the blocks wholly before `first_position`, the first key any token the
        sequence has yet to run may see (a model whose every layer has a sliding window): a long
        stream then holds about window / block_size blocks. They stay in the prefix cache, as
        committed blocks, until the pool reuses them."""
        count = min(first_position // self.block_size, table.num_committed_blocks)
        if count > table.num_released_blocks:
            self.pool.release(table.block_ids[table.num_released_blocks : count][::-1])
            table.num_released_blocks = count

    def release_held(self, block_ids: list[int]) -> None:
        """Drop the references held on `block_ids` (last first) and empty the list."""
        self.pool.release(block_ids[::-1])
        block_ids.clear()

    def free(self, table: BlockTable) -> None:
        """Release the table's blocks, tail first, so shared prefixes stay cached the longest."""
        self.pool.release(table.block_ids[table.num_released_blocks :][::-1])
        table.block_ids = []
        table.num_committed_blocks = 0
        table.num_released_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget all cached KV (the workers' cache memory was lost)."""
        self.pool.clear_cache()
