"""The P/D proxy's own /metrics: requests by route and status, per-instance state, fallbacks.

Counters the proxy increments as it routes; the per-instance gauges (up, outstanding requests,
times marked down, failures in a row) are read from the pool at scrape time so they can never
drift from it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.proxy.pool import InstancePool

PREFIX = "engine:proxy_"


class ProxyMetrics:
    def __init__(self, pool: InstancePool) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "Client requests by route and the status answered",
            ["route", "status"],
            registry=registry,
        )
        self.prefill_fallbacks = Counter(
            PREFIX + "prefill_fallbacks",
            "Requests sent to a decode instance without KV (no prefill instance could prefill)",
            registry=registry,
        )
        self.without_kv = Counter(
            PREFIX + "prefill_without_kv",
            "Prefills answered without kv_transfer_params (the decode instance prefills itself)",
            registry=registry,
        )
        self.retries = Counter(
            PREFIX + "retries",
            "Requests sent again to another instance after one failed, by role",
            ["role"],
            registry=registry,
        )
        self.upstream_5xx = Counter(
            PREFIX + "upstream_5xx",
            "5xx answers from instances, by role (sent once elsewhere, then relayed; never a "
            "reason to mark an instance down)",
            ["role"],
            registry=registry,
        )
        self.broken_streams = Counter(
            PREFIX + "broken_streams",
            "Streams whose decode instance failed after the first byte (ended with an error event)",
            registry=registry,
        )
        registry.register(_PoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector(Collector):
    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "url"]
        up = GaugeMetricFamily(PREFIX + "instance_up", "1 while the instance is up", labels=labels)
        busy = GaugeMetricFamily(
            PREFIX + "instance_outstanding", "Requests in flight on the instance", labels=labels
        )
        failures = CounterMetricFamily(
            PREFIX + "instance_failures", "Times the instance was marked down", labels=labels
        )
        strikes = GaugeMetricFamily(
            PREFIX + "instance_strikes",
            "Failed probes (and missed first bytes) in a row since the last good probe",
            labels=labels,
        )
        for instance in self.pool.instances:
            key = [instance.role.value, instance.url]
            up.add_metric(key, 1.0 if instance.up else 0.0)
            busy.add_metric(key, float(instance.outstanding))
            failures.add_metric(key, float(instance.failures))
            strikes.add_metric(key, float(instance.strikes))
        yield from (up, busy, failures, strikes)
