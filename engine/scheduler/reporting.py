"""What the scheduler reports of itself: its figures and the admin listing of its requests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from engine.kv.cache.block_manager import BlockManager
from engine.messages.scheduling import RequestStatus, SchedulerStats
from engine.scheduler.kv_handoff import KvTransfer
from engine.scheduler.policy import BatchPlanner
from engine.scheduler.requests import Request


def scheduler_stats(
    kv: BlockManager,
    planner: BatchPlanner,
    counts: tuple[int, int],
    kv_transfer: KvTransfer | None,
    parts: Mapping[str, Any],
) -> SchedulerStats:
    """The figures of a scheduler: its KV cache and batch, `counts` (requests, steps), P/D's
    holds and pulls, and its optional parts' fields (speculation's tally, the disk tier's)."""
    num_requests, num_steps = counts
    stats = SchedulerStats(
        num_running=len(planner.running),
        num_waiting=len(planner.waiting),
        num_requests=num_requests,
        kv_usage=kv.usage,
        num_free_blocks=kv.num_free_blocks,
        num_cached_blocks=kv.pool.num_cached_free_blocks,
        prefix_cache_hit_rate=kv.prefix_stats.hit_rate,
        prefix_cache_queried_tokens=kv.prefix_stats.queried_tokens,
        prefix_cache_hit_tokens=kv.prefix_stats.hit_tokens,
        num_preemptions=planner.num_preemptions,
        num_steps=num_steps,
    )
    extra = {**(kv_transfer.stats() if kv_transfer is not None else {}), **parts}
    return msgspec.structs.replace(stats, **extra) if extra else stats


def request_statuses(requests: Iterable[Request], now: float) -> list[RequestStatus]:
    return [
        RequestStatus(
            request_id=request.request_id,
            epoch=request.epoch,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=[seq.num_output_tokens for seq in request.samples.values()],
            states=[seq.status.value for seq in request.samples.values()],
            num_preemptions=request.num_preemptions,
            age_s=now - request.arrival,
        )
        for request in requests
    ]
