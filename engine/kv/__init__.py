"""KV cache bookkeeping: block pool, block tables, prefix cache (no tensors live here)."""

from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import BlockPool, OutOfBlocksError
from engine.kv.block_table import BlockTable
from engine.kv.prefix_cache import BlockHashChain, PrefixCacheStats, hash_block

__all__ = [
    "BlockHashChain",
    "BlockManager",
    "BlockPool",
    "BlockTable",
    "OutOfBlocksError",
    "PrefixCacheStats",
    "hash_block",
]
