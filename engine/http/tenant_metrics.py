"""/metrics by tenant, on a server with a tenants file: requests admitted, tokens charged (prompt
and generated), requests in flight and quota refusals, labelled `tenant`. The labels are the
tenants file's names, so their number is the file's: a client cannot add one. A tenant removed
by a reload leaves the output with it."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.tenants.directory import Tenants

PREFIX = "engine:tenant_"
QUOTAS = ("concurrent_requests", "tokens_per_minute")


class TenantCollector(Collector):
    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants

    def collect(self) -> Iterator[Metric]:
        book = self.tenants.quotas
        names = [tenant.name for tenant in self.tenants.all()]
        requests = CounterMetricFamily(
            PREFIX + "requests", "Requests admitted, by tenant", labels=["tenant"]
        )
        tokens = CounterMetricFamily(
            PREFIX + "tokens",
            "Tokens charged to the tenant (prompt and generated) as its requests ended",
            labels=["tenant"],
        )
        in_flight = GaugeMetricFamily(
            PREFIX + "requests_in_flight", "Requests of the tenant in flight", labels=["tenant"]
        )
        throttled = CounterMetricFamily(
            PREFIX + "throttled",
            "Requests refused (429) by one of the tenant's quotas",
            labels=["tenant", "quota"],
        )
        for name in names:
            requests.add_metric([name], book.admitted[name])
            tokens.add_metric([name], book.charged_tokens[name])
            in_flight.add_metric([name], book.usage(name)[2])
            for quota in QUOTAS:
                throttled.add_metric([name, quota], book.throttled[name, quota])
        yield from (requests, tokens, in_flight, throttled)
