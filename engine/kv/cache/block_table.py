"""One sequence's block table: the physical KV blocks that hold its tokens, in order."""

from __future__ import annotations


class BlockTable:
    """Block i holds the KV of token positions [i * block_size, (i + 1) * block_size).

    `num_committed_blocks` leading blocks are full and computed: their KV is final, so they may be
    indexed in the prefix cache and shared with other sequences; nothing writes to them again.
    `num_released_blocks` leading blocks lie wholly before the sliding window of every token the
    sequence has yet to run: they went back to the pool (their ids stay, never read again).
    """

    __slots__ = ("block_ids", "num_committed_blocks", "num_released_blocks")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.num_committed_blocks = 0
        self.num_released_blocks = 0

    def __len__(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return f"BlockTable({self.block_ids}, committed={self.num_committed_blocks})"
