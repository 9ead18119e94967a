"""Prometheus metrics on the server's own registry: vLLM's set under the `engine:` prefix.

Every metric carries vLLM's `model_name` label, so a vLLM dashboard or autoscaler works once its
`vllm:` prefix reads `engine:`. Request-level figures (TTFT, inter-token latency, end-to-end,
queue, prefill and decode times, token counts, successes by finish reason) are observed by the
HTTP layer as requests run; engine-level figures (running / waiting requests, KV usage,
prefix-cache queries and hits, preemptions, actor restarts, resubmissions, speculative
decoding's drafts, draft tokens and accepted tokens, also by position) are read from
`llm.stats()` at scrape time. Ours beside vLLM's: `engine:http_requests_total` (by endpoint and
outcome), `engine:actor_restarts_total`, `engine:request_resubmissions_total`,
`engine:stalled_stream_aborts_total`, `engine:model_weight_bytes` (by format: what the weights
are served as), where a running batch's time goes (`engine:steps_total`,
`engine:step_compute_seconds_total`, `engine:step_gaps_total`, `engine:step_gap_seconds_total`,
`engine:step_gap_scheduler_seconds_total`: engine/scheduler/step_times.py), each actor's CPU
seconds (`engine:actor_cpu_seconds_total`, by actor), how long restarts kept each actor down
(`engine:actor_recovery_seconds_total`) and how full each ring is (`engine:ring_occupancy_perc`).
Every family is declared (HELP and TYPE) from the first scrape, samples or not, so dashboards and
alert rules can be checked against any running server (deploy/grafana/, deploy/prometheus/).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.http.kv_disk_metrics import kv_disk_metrics
from engine.http.kv_metrics import kv_transfer_metrics
from engine.messages.admin import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "engine:"

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# vLLM's: 1, 2, 5 x powers of ten
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
_REQUEST_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


# The engine's figures (EngineStats fields) under their metric names: (name, help, field).
_ENGINE_GAUGES = (
    ("num_requests_running", "Requests in the running batch", "num_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled", "num_waiting"),
    ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)", "kv_usage"),
)
_ENGINE_COUNTERS = (
    (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
        "prefix_cache_queried_tokens",
    ),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hit_tokens"),
    ("num_preemptions", "Sequences preempted (to be recomputed)", "num_preemptions"),
    (
        "request_resubmissions",
        "Requests resubmitted after an actor restart",
        "resubmitted_requests",
    ),
    (
        "stalled_stream_aborts",
        "Requests aborted because their client stopped reading",
        "stalled_stream_aborts",
    ),
    ("steps", "Model steps run", "num_steps"),
    (
        "spec_decode_num_drafts",
        "Decode steps of a sequence that verified proposed tokens",
        "spec_decode_num_drafts",
    ),
    ("spec_decode_num_draft_tokens", "Proposed tokens verified", "spec_decode_num_draft_tokens"),
    (
        "spec_decode_num_accepted_tokens",
        "Proposed tokens accepted",
        "spec_decode_num_accepted_tokens",
    ),
    (
        "step_compute_seconds",
        "Seconds rank 0 spent computing steps (plan taken in to result ready)",
        "step_compute_seconds",
    ),
    ("step_gaps", "Gaps between two steps of a running batch", "step_gaps"),
    (
        "step_gap_seconds",
        "Seconds the workers waited in those gaps (result ready to next plan taken in)",
        "step_gap_seconds",
    ),
    (
        "step_gap_scheduler_seconds",
        "The scheduler's part of the gaps (result read to next plan made)",
        "step_gap_scheduler_seconds",
    ),
)


# A loaded model's live figures as the collector reads them: its name, its stats, and the
# resident bytes of one rank's weights by format.
LoadedModel = tuple[str, Callable[[], EngineStats], dict[str, int]]


class ServerMetrics:
    def __init__(
        self,
        loaded_models: Callable[[], Iterable[LoadedModel]],
        model_name: str,
        catalogue: Callable[[], Iterable[Metric]] | None = None,
    ) -> None:
        """`loaded_models`: each loaded model's figures, read at scrape time; `model_name`:
        the model a request names when it names none; `catalogue`: the families of the models'
        loads and unloads (engine/http/model_metrics.py)."""
        # *_created series only add noise to every scrape
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.prompt_token_count = 0  # the same as the counters, for the periodic stats line
        self.generation_token_count = 0
        self._declare_latencies()
        self._declare_counts()
        self.registry.register(_EngineStatsCollector(loaded_models, catalogue))

    def for_model(self, name: str) -> ModelMetrics:
        """The same metrics, labelled with model `name`: what one request observes."""
        return ModelMetrics(self, name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        label = ["model_name"]
        return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=self.registry)

    def _declare_latencies(self) -> None:
        """vLLM's per-request histograms, observed by the HTTP layer as requests run."""
        histogram = self._histogram
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time from request arrival to its first output token",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between successive output tokens of one sample",
            _LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "A request's decode time divided by its output tokens after the first",
            _LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its end", _REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited in the scheduler's queue before its first step",
            _REQUEST_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Time from a request's first step to its first token",
            _REQUEST_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Time from a request's first token to its last",
            _REQUEST_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Tokens generated for each finished request (all its choices)",
            _TOKEN_BUCKETS,
        )

    def _declare_counts(self) -> None:
        """Requests by outcome and finish reason, and tokens."""
        registry, label = self.registry, ["model_name"]
        self.requests = Counter(
            PREFIX + "http_requests",
            "HTTP API requests by endpoint and outcome",
            ["model_name", "endpoint", "outcome"],
            registry=registry,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason (stop, length, abort)",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests", label, registry=registry
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated", label, registry=registry
        )

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.for_model(self.model_name).count_request(endpoint, outcome)

    def add_prompt_tokens(self, count: int) -> None:
        self.for_model(self.model_name).add_prompt_tokens(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """The server's metrics as one model's requests observe them (labelled with its name)."""

    def __init__(self, server: ServerMetrics, model_name: str) -> None:
        self.server = server
        self.model_name = model_name
        self.ttft, self.itl, self.tpot = server.ttft, server.itl, server.tpot
        self.e2e, self.queue_time = server.e2e, server.queue_time
        self.prefill_time, self.decode_time = server.prefill_time, server.decode_time
        self.request_prompt_tokens = server.request_prompt_tokens
        self.request_generation_tokens = server.request_generation_tokens
        self.request_success = server.request_success

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.server.requests.labels(self.model_name, endpoint, outcome).inc()

    def add_prompt_tokens(self, count: int) -> None:
        self.server.prompt_token_count += count
        self.server.prompt_tokens.labels(self.model_name).inc(count)

    def add_generation_tokens(self, count: int) -> None:
        self.server.generation_token_count += count
        self.server.generation_tokens.labels(self.model_name).inc(count)


class _EngineStatsCollector(Collector):
    """Reads the loaded models' live figures when Prometheus scrapes, so they are never stale.
    Each family holds every loaded model's samples (a family appears once in a scrape)."""

    def __init__(
        self,
        loaded_models: Callable[[], Iterable[LoadedModel]],
        catalogue: Callable[[], Iterable[Metric]] | None,
    ) -> None:
        self._loaded_models = loaded_models
        self._catalogue = catalogue

    def describe(self) -> list[Metric]:
        return []  # figures depend on live engines; nothing to declare up front

    def collect(self) -> Iterator[Metric]:
        families: list[Metric] = []
        for name, engine_stats, weight_bytes in self._loaded_models():
            try:
                stats = engine_stats()
            except Exception:  # a scrape must not fail because an engine is restarting
                continue
            families += self._model_families(name, stats, weight_bytes)
        if self._catalogue is not None:
            families += self._catalogue()
        yield from merged_families(families)

    def _model_families(
        self, model_name: str, stats: EngineStats, weight_bytes: dict[str, int]
    ) -> Iterator[Metric]:
        model = [model_name]
        for name, doc, field in _ENGINE_GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric(model, float(getattr(stats, field)))
            yield gauge
        for name, doc, field in _ENGINE_COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(model, float(getattr(stats, field)))
            yield counter
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by their position among a step's proposals",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            per_position.add_metric([model_name, str(position)], float(count))
        yield per_position
        weights = GaugeMetricFamily(
            PREFIX + "model_weight_bytes",
            "Resident bytes of one rank's weights, by format (a GGUF type or quantization "
            "scheme kept quantized, else the dtype)",
            labels=["model_name", "format"],
        )
        for weight_format, size in weight_bytes.items():
            weights.add_metric([model_name, weight_format], float(size))
        yield weights
        yield from self._per_actor(model_name, stats)
        yield from self._recovery_and_rings(model_name, stats)
        yield from kv_transfer_metrics(stats, model_name)
        yield from kv_disk_metrics(stats, model_name)

    def _per_actor(self, model_name: str, stats: EngineStats) -> Iterator[Metric]:
        """Restarts and CPU seconds by actor; frames and bytes by actor and ring."""
        family = CounterMetricFamily(
            PREFIX + "actor_restarts", "Restarts of each actor", labels=["model_name", "actor"]
        )
        for actor, count in sorted(stats.restarts.items()):
            family.add_metric([model_name, actor], float(count))
        yield family
        cpu = CounterMetricFamily(
            PREFIX + "actor_cpu_seconds",
            "CPU seconds of each actor's current process (root: the server's own)",
            labels=["model_name", "actor"],
        )
        for actor, seconds in sorted(stats.actor_cpu.items()):
            cpu.add_metric([model_name, actor], seconds)
        yield cpu
        labels = ["model_name", "actor", "ring"]
        frames = CounterMetricFamily(
            PREFIX + "ring_frames_sent", "Frames each actor wrote to each ring", labels=labels
        )
        sent = CounterMetricFamily(
            PREFIX + "ring_bytes_sent", "Bytes each actor wrote to each ring", labels=labels
        )
        for row in stats.ring_traffic:
            frames.add_metric([model_name, row.actor, row.ring], float(row.frames))
            sent.add_metric([model_name, row.actor, row.ring], float(row.bytes))
        yield frames
        yield sent

    def _recovery_and_rings(self, model_name: str, stats: EngineStats) -> Iterator[Metric]:
        """How long restarts kept each actor down, and how full each ring is."""
        recovery = CounterMetricFamily(
            PREFIX + "actor_recovery_seconds",
            "Seconds from each actor's death to its next generation ready, over its restarts "
            "(divide by actor_restarts for the mean)",
            labels=["model_name", "actor"],
        )
        for actor, seconds in sorted(stats.actor_recovery_seconds.items()):
            recovery.add_metric([model_name, actor], seconds)
        yield recovery
        fill = GaugeMetricFamily(
            PREFIX + "ring_occupancy_perc",
            "Fraction of each ring its writer has written and its slowest reader not yet read "
            "(0 to 1), as of the writer's last heartbeat",
            labels=["model_name", "actor", "ring"],
        )
        for row in stats.ring_traffic:
            fill.add_metric([model_name, row.actor, row.ring], row.fill)
        yield fill


def merged_families(families: Iterable[Metric]) -> Iterator[Metric]:
    """One family per name, holding the samples of every family of that name, in first-seen
    order."""
    by_name: dict[str, Metric] = {}
    for family in families:
        first = by_name.setdefault(family.name, family)
        if first is not family:
            first.samples.extend(family.samples)
    yield from by_name.values()
