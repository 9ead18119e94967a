"""KV cache bookkeeping: block pool, block tables, prefix cache (no tensors live here)."""

from engine.kv.cache.block_manager import BlockManager
from engine.kv.cache.block_pool import BlockPool, OutOfBlocksError
from engine.kv.cache.block_table import BlockTable
from engine.kv.cache.prefix_cache import BlockHashChain, PrefixCacheStats, hash_block

__all__ = [
    "BlockHashChain",
    "BlockManager",
    "BlockPool",
    "BlockTable",
    "OutOfBlocksError",
    "PrefixCacheStats",
    "hash_block",
]
