"""/metrics for P/D disaggregation: each instance's KV transfers (one-launch P/D: each replica;
across instances: this one), labelled with its replica index and role."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.messages.admin import EngineStats

PREFIX = "engine:kv_transfer_"

GAUGES = (
    ("holds", "Handed-off requests whose KV blocks are held for a puller", "kv_holds"),
    ("pulls_in_flight", "Requests waiting for their KV to arrive", "kv_pulls_in_flight"),
)
COUNTERS = (
    ("handoffs", "Requests handed on after their prefill, KV held", "kv_handoffs"),
    (
        "holds_refused",
        "Handoffs whose KV was not held: held blocks at their cap (half the pool)",
        "kv_holds_refused",
    ),
    (
        "holds_expired",
        "Holds freed by kv_transfer.hold_timeout, unacknowledged",
        "kv_holds_expired",
    ),
    ("pulls", "Pulls whose KV arrived", "kv_pulls"),
    ("blocks_pulled", "KV blocks pulled (per rank: each rank moves its shard)", "kv_blocks_pulled"),
    ("bytes_pulled", "Bytes of KV pulled, every rank's together", "kv_bytes_pulled"),
    ("pull_seconds", "Seconds spent in pulls that arrived (divide by pulls)", "kv_pull_seconds"),
    ("fallbacks", "Requests that computed their prompt: its KV did not arrive", "kv_fallbacks"),
    ("blocks_from_cache", "Source blocks the prefix cache had, not pulled", "kv_blocks_from_cache"),
    (
        "refused_connections",
        "KV transfer connections refused: the peer did not prove the deployment secret",
        "kv_refused_connections",
    ),
)


def kv_transfer_metrics(stats: EngineStats, model_name: str) -> Iterator[Metric]:
    """Without P/D the families are declared with no samples (a dashboard's query is valid)."""
    rows = [row for row in stats.replicas if row.role != "both"]
    labels = ["model_name", "replica", "role"]
    for kind, table in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
        for name, doc, field in table:
            family = kind(PREFIX + name, doc, labels=labels)
            for row in rows:
                family.add_metric([model_name, str(row.replica), row.role], getattr(row, field))
            yield family
