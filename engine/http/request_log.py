"""The periodic throughput / queue / KV cache line (every 10 s unless --disable-log-stats)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.http.state import ServerState

stats_log = logging.getLogger("engine.stats")

STATS_INTERVAL_S = 10.0


async def log_stats_forever(state: ServerState, interval: float = STATS_INTERVAL_S) -> None:
    """Every `interval` seconds: throughput since the last line, queue, KV use, cache hits."""
    metrics = state.metrics
    last = time.monotonic()
    prompt, generated = metrics.prompt_token_count, metrics.generation_token_count
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        elapsed = max(now - last, 1e-9)
        try:
            every = [served.llm.stats() for _, served in state.models.loaded()]
        except Exception:  # an engine is restarting: try again next time
            continue
        if not every:
            continue  # no model loaded: nothing ran
        stats = every[0]
        stats_log.info(
            "prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, "
            "running %d, waiting %d, KV cache usage %.1f%%, prefix cache hit rate %.1f%%",
            (metrics.prompt_token_count - prompt) / elapsed,
            (metrics.generation_token_count - generated) / elapsed,
            sum(one.num_running for one in every),
            sum(one.num_waiting for one in every),
            100 * stats.kv_usage,
            100 * stats.prefix_cache_hit_rate,
        )
        last, prompt, generated = now, metrics.prompt_token_count, metrics.generation_token_count
