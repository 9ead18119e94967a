"""Prefix-cache keys: a chain of hashes over full KV blocks, and the cache's hit statistics.

Block i's key is hash(key of block i-1, token ids of block i), so a key names the whole prefix up
to the end of its block: two sequences share block i's KV exactly when their keys match. Keys
are 128-bit BLAKE2b digests, so a collision (two different prefixes, one key) is not a concern.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_ROOT = b"engine-kv-prefix-v1"


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The key of a full block holding `token_ids`, following the block whose key is `parent`."""
    digest = hashlib.blake2b(parent if parent is not None else _ROOT, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def scope_salt(cache_scope: str, cache_salt: str | None) -> bytes:
    """What keys a request's KV beside its tokens and adapter: its tenant's cache scope and its
    own salt (vLLM's `cache_salt`); b"" for neither, so a server without tenants keys as before.
    Each part is length-prefixed: no salt a client chooses can spell another tenant's scope."""
    if not cache_scope and cache_salt is None:
        return b""
    parts = [cache_scope.encode(), (cache_salt or "").encode()]
    flag = b"s" if cache_salt is not None else b"-"
    return b"scope" + flag + b"".join(len(part).to_bytes(4, "big") + part for part in parts)


class BlockHashChain:
    """One sequence's block keys, extended lazily as its tokens fill more blocks.

    A sequence's tokens only ever grow at the end, so keys computed once stay valid. `salt`
    names what else its KV depends on (a LoRA adapter): chains of different salts share no key.
    """

    def __init__(self, block_size: int, salt: bytes = b"") -> None:
        self.block_size = block_size
        self.hashes: list[bytes] = []
        self.root = hashlib.blake2b(_ROOT + salt, digest_size=16).digest() if salt else None

    def first(self, token_ids: Sequence[int], num_blocks: int) -> list[bytes]:
        """Keys of the first `num_blocks` blocks of `token_ids` (which must all be full)."""
        if num_blocks > 0:
            self.key(token_ids, num_blocks - 1)
        return self.hashes[:num_blocks]

    def key(self, token_ids: Sequence[int], index: int) -> bytes:
        """Key of block `index` of `token_ids` (which must be full)."""
        size = self.block_size
        if (index + 1) * size > len(token_ids):
            raise ValueError(
                f"block {index} of {size} tokens is not full: the sequence has {len(token_ids)}"
            )
        while len(self.hashes) <= index:
            start = len(self.hashes) * size
            parent = self.hashes[-1] if self.hashes else self.root
            self.hashes.append(hash_block(parent, token_ids[start : start + size]))
        return self.hashes[index]


class PrefixCacheStats:
    """Hit tokens over queried tokens, counted once per prefix lookup."""

    def __init__(self) -> None:
        self.queried_tokens = 0
        self.hit_tokens = 0

    def record(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
