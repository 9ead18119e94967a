"""Prometheus metrics on the server's own registry.

Request-level figures (outcomes, TTFT, inter-token latency, end-to-end latency, token counts) are
observed by the HTTP layer as requests run; engine-level figures (running / waiting requests, KV
usage, prefix-cache hit rate, actor restarts) are read from `llm.stats()` at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.messages.admin import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        disable_created_metrics()  # *_created series only add noise to every scrape
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "engine_requests",
            "HTTP API requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "engine_time_to_first_token_seconds",
            "Time from request arrival to its first output token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "engine_inter_token_latency_seconds",
            "Time between successive output tokens of one sample",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "engine_e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "engine_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "engine_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.registry.register(_EngineStatsCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineStatsCollector(Collector):
    """Reads the engine's live figures when Prometheus scrapes, so they are never stale."""

    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self._engine_stats = engine_stats

    def describe(self) -> list[Metric]:
        return []  # figures depend on a live engine; nothing to declare up front

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._engine_stats()
        except Exception:  # a scrape must not fail because the engine is restarting
            return
        gauges = (
            ("engine_requests_running", "Requests in the running batch", stats.num_running),
            ("engine_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting),
            ("engine_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", stats.kv_usage),
            (
                "engine_prefix_cache_hit_rate",
                "Fraction of prompt tokens served from the prefix cache",
                stats.prefix_cache_hit_rate,
            ),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=float(value))
        family = CounterMetricFamily(
            "engine_actor_restarts", "Restarts of each actor", labels=["actor"]
        )
        for actor, count in sorted(stats.restarts.items()):
            family.add_metric([actor], float(count))
        yield family
