"""What the scheduler needs to know about the engine it schedules for."""

from __future__ import annotations

import msgspec

from engine.kv.disk.config import KvDiskConfig
from engine.scheduler.speculation import parse_speculative_config


def plan_bytes_of_one_sequence(max_model_len: int) -> int:
    """The most a step plan spends on one sequence of max_model_len tokens: its request (prompt),
    its history and its whole block table, at the widest id encoding (5 bytes)."""
    return 5 * 3 * max_model_len + 4096


def longest_in_a_plan(max_plan_bytes: int) -> int:
    """The longest max_model_len whose sequence fits a plan of max_plan_bytes alone."""
    return max(0, (max_plan_bytes - 4096) // 15)


class SchedulerConfig(msgspec.Struct, kw_only=True):
    num_blocks: int  # KV blocks in the pool (what the workers allocated)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # sequences holding KV blocks at once
    max_num_batched_tokens: int = 2048  # tokens run through the model in one step
    max_model_len: int = 4096  # prompt + output tokens of one sequence
    default_max_tokens: int = 0  # output tokens of a sample without max_tokens (0: no limit)
    enable_prefix_caching: bool = True
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    # Bytes one StepPlan may take: the frame must fit the plan ring (messages/steps.py).
    max_plan_bytes: int = 4 * 2**20
    # P/D disaggregation: how many kv_transfer actors (one per worker rank; 0: none, KV never
    # moves), and how long a handed-off request's blocks are held for the puller.
    kv_transfer_ranks: int = 0
    kv_hold_timeout: float = 30.0
    max_loras: int = 0  # distinct LoRA adapters in one step; 0: no limit (or LoRA off)
    speculative_config: str = ""  # vLLM's --speculative-config JSON (speculation.py); "": off
    # The workers' KV cache lives in segments of the run (CPU), so it outlives a worker's
    # restart; the prefix cache's index is mirrored in the segment named here ("": none), so
    # that it outlives the scheduler's (engine/kv/cache/prefix_index.py, launch/lasting_kv.py).
    kv_outlives_workers: bool = False
    prefix_index_segment: str = ""
    # Every layer of the model sees at most this many keys (0: no window): a sequence's blocks
    # before its window go back to the pool as it runs (not with P/D or a draft model, which
    # read a sequence's blocks on their own terms).
    sliding_window: int = 0
    # The prefix cache's disk tier (engine/kv/disk/; None: off), run on a thread of the
    # scheduler's process over the ranks' cache segments.
    kv_disk: KvDiskConfig | None = None

    @property
    def window_tokens(self) -> int:
        """The most tokens' KV one sequence holds with its window's blocks released (a chunk
        and the window, at block granularity); 0: no window."""
        if not self.sliding_window:
            return 0
        return self.sliding_window + self.max_num_batched_tokens + 2 * self.block_size

    def validate(self) -> None:
        """Raise ValueError naming the offending setting, its value and the allowed range."""
        parse_speculative_config(self.speculative_config)
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.max_model_len > longest_in_a_plan(self.max_plan_bytes):
            one_sequence = plan_bytes_of_one_sequence(self.max_model_len)
            raise ValueError(
                f"a step plan of {self.max_plan_bytes} bytes cannot carry one sequence of "
                f"max_model_len {self.max_model_len} (up to {one_sequence} bytes): lower "
                "max_model_len"
            )
        capacity = self.num_blocks * self.block_size
        if capacity < min(self.max_model_len, self.window_tokens or self.max_model_len):
            # Otherwise one long sequence could never fit, and would preempt itself forever.
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of "
                f"{self.block_size}), fewer than max_model_len {self.max_model_len}: "
                "lower max_model_len or give the cache more blocks"
            )
