"""/metrics for the prefix cache's disk tier (engine/scheduler/disk_tier.py): every replica's
figures summed. Declared from the first scrape, with zeros while the tier is off."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.messages.admin import EngineStats

PREFIX = "engine:kv_disk_"

GAUGES = (
    (
        "loads_waiting",
        "Requests waiting for their KV blocks to be read from disk",
        "kv_disk_loads_waiting",
    ),
    (
        "unwritten_blocks",
        "KV blocks waiting to be written to disk, or being written",
        "kv_disk_unwritten_blocks",
    ),
    ("full", "Schedulers whose disk is full (their writes stopped for now)", "kv_disk_full"),
)
COUNTERS = (
    ("hit_blocks", "KV blocks read back from disk into the prefix cache", "kv_disk_hit_blocks"),
    ("read_bytes", "Bytes of KV read from disk", "kv_disk_read_bytes"),
    ("written_blocks", "KV blocks written to disk", "kv_disk_written_blocks"),
    ("written_bytes", "Bytes of KV written to disk", "kv_disk_written_bytes"),
    (
        "evicted_blocks",
        "Block files removed to keep the tier within cache.kv_disk_size",
        "kv_disk_evicted_blocks",
    ),
    (
        "dropped_blocks",
        "Block files that failed their checks (torn, truncated, corrupt, foreign "
        "or not the user's): removed, never served",
        "kv_disk_dropped_blocks",
    ),
    (
        "skipped_blocks",
        "KV blocks evicted from RAM before they could be written",
        "kv_disk_skipped_blocks",
    ),
    ("loads", "Reads of a request's blocks from disk that ended", "kv_disk_loads"),
)


def kv_disk_metrics(stats: EngineStats, model_name: str) -> Iterator[Metric]:
    for kind, table in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
        for name, doc, field in table:
            family = kind(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([model_name], float(getattr(stats, field)))
            yield family
