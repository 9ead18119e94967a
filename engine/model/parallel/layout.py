"""How a model splits over tensor-parallel ranks: pure arithmetic on ModelConfig, no torch.

Megatron's split: attention by heads (each rank owns num_heads / N query heads and the KV heads
they read), the MLP by intermediate columns, the vocabulary by rows (padded to N equal shards).
With fewer KV heads than ranks, every rank keeps the one KV head its query heads share: KV heads
are replicated, num_ranks / num_kv_heads times each.

The root process imports this (to check a size and to size the KV cache per rank); keep it
free of torch.
"""

from __future__ import annotations

import dataclasses

from engine.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class RankShape:
    """The slice of the model one rank holds."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (replicated ones included)
    head_start: int  # first query head (global index)
    kv_head_start: int  # first KV head (global index)
    intermediate_size: int  # MLP columns on this rank
    intermediate_start: int
    vocab_per_rank: int  # rows of the embedding / LM head shard (the last may be padding)
    vocab_start: int  # first vocabulary id of this rank's shard
    vocab_end: int  # one past the last real id (<= vocab_start + vocab_per_rank)

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming both numbers when `size` ranks cannot split this model evenly."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size}")
    problems = []
    if config.num_heads % size:
        problems.append(f"num_attention_heads {config.num_heads}")
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(
            f"num_key_value_heads {kv} (with fewer KV heads than ranks, the size must be a "
            "multiple of num_key_value_heads)"
        )
    if config.intermediate_size % size:
        problems.append(f"intermediate_size {config.intermediate_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model: "
            + "; ".join(f"{problem} is not divisible by {size}" for problem in problems)
        )


def rank_shape(config: ModelConfig, rank: int, size: int) -> RankShape:
    """This rank's slice; check_tensor_parallel first for a clear error on a bad size."""
    check_tensor_parallel(config, size)
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank must be in 0..{size - 1}, got {rank}")
    heads = config.num_heads // size
    kv_heads = max(1, config.num_kv_heads // size)
    # Query head h reads KV head h // (num_heads / num_kv_heads); a rank's heads share one group
    # or span whole groups, so its KV heads start where its first query head's group does.
    kv_start = rank * heads * config.num_kv_heads // config.num_heads
    columns = config.intermediate_size // size
    vocab_per_rank = -(-config.vocab_size // size)
    vocab_start = min(rank * vocab_per_rank, config.vocab_size)
    return RankShape(
        rank=rank,
        size=size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_start=rank * heads,
        kv_head_start=kv_start,
        intermediate_size=columns,
        intermediate_start=rank * columns,
        vocab_per_rank=vocab_per_rank,
        vocab_start=vocab_start,
        vocab_end=min(vocab_start + vocab_per_rank, config.vocab_size),
    )


def kv_heads_per_rank(config: ModelConfig, size: int) -> int:
    return max(1, config.num_kv_heads // size)
