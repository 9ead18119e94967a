"""KV cache bookkeeping: block pool, block tables, prefix cache (no tensors live here)."""

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.block_pool import BlockPool, OutOfBlocksError
from engine.kvcache.block_table import BlockTable
from engine.kvcache.prefix_cache import BlockHashChain, PrefixCacheStats, hash_block

__all__ = [
    "BlockHashChain",
    "BlockManager",
    "BlockPool",
    "BlockTable",
    "OutOfBlocksError",
    "PrefixCacheStats",
    "hash_block",
]
