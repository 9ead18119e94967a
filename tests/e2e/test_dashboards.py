"""The Grafana dashboard (deploy/grafana/) and the Prometheus alert rules (deploy/prometheus/)
name only metrics a running server exports: every PromQL expression is parsed, and each metric
it selects must be declared in the shared server's /metrics (families with no samples yet
included: their HELP and TYPE lines are there from the first scrape)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from tests.e2e.harness import REPO, Server

DASHBOARD = REPO / "deploy" / "grafana" / "engine-dashboard.json"
ALERTS = REPO / "deploy" / "prometheus" / "engine-alerts.yml"

# Grafana's range variables are not PromQL: any valid duration stands in for them.
_GRAFANA_RANGE = re.compile(r"\$(__rate_interval|__interval|__range|\{__\w+\})")
_LABEL_VALUES = re.compile(r"label_values\(\s*([^,)]+)")
# Series names each TYPE of family exposes
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def selected_metrics(expr: str) -> list[str]:
    """The metric names an expression selects (a syntax error raises ValueError)."""
    tree = promql_parser.parse(_GRAFANA_RANGE.sub("5m", expr))
    names: list[str] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            names.append(node.name)
        return True

    promql_parser.walk(tree, visit)
    return names


def exported_series(metrics_text: str) -> set[str]:
    """Every series name /metrics declares, from its TYPE lines."""
    series: set[str] = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            series.update(name + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return series


def dashboard_queries(node: Any) -> Iterator[str]:
    """Every panel target's expression, nested rows included, and each template variable's
    label_values() metric as a selector of its own."""
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            yield node["expr"]
        definition = node.get("definition")
        if isinstance(definition, str) and (match := _LABEL_VALUES.search(definition)):
            yield match[1].strip()
        for value in node.values():
            yield from dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_queries(item)


def alert_queries(path: Path) -> dict[str, str]:
    rules = yaml.safe_load(path.read_text())
    return {
        rule.get("alert") or rule["record"]: rule["expr"]
        for group in rules["groups"]
        for rule in group["rules"]
    }


def unexported(queries: list[str], series: set[str]) -> dict[str, list[str]]:
    missing = {}
    for expr in queries:
        names = selected_metrics(expr)
        assert names, f"selects no metric: {expr}"
        absent = [name for name in names if name not in series]
        if absent:
            missing[expr] = absent
    return missing


@pytest.fixture(scope="module")
def series(server: Server) -> set[str]:
    with server.http() as http:
        return exported_series(http.get("/metrics").text)


def test_a_misnamed_metric_is_caught() -> None:
    series = exported_series("# TYPE engine:x_seconds histogram\n# TYPE engine:y_total counter\n")
    good = "histogram_quantile(0.9, sum by (le) (rate(engine:x_seconds_bucket[$__rate_interval])))"
    bad = 'rate(engine:y{model_name="$model_name"}[5m]) / rate(engine:x_seconds_count[5m])'
    assert unexported([good, bad], series) == {bad: ["engine:y"]}
    with pytest.raises(ValueError):
        selected_metrics("sum by (le (rate(engine:x_seconds_bucket[5m]))")


def test_every_dashboard_metric_is_exported(series: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = list(dashboard_queries(dashboard))
    assert unexported(queries, series) == {}
    named = {name for expr in queries for name in selected_metrics(expr)}
    # The panels the dashboard exists for: vLLM's, then supervision, rings and P/D.
    for metric in (
        "e2e_request_latency_seconds_bucket",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "time_per_output_token_seconds_bucket",
        "generation_tokens_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "actor_restarts_total",
        "request_resubmissions_total",
        "actor_recovery_seconds_total",
        "ring_occupancy_perc",
        "kv_transfer_bytes_pulled_total",
        "kv_transfer_pull_seconds_total",
    ):
        assert "engine:" + metric in named, metric


def test_every_alert_metric_is_exported(series: set[str]) -> None:
    queries = alert_queries(ALERTS)
    assert {"EngineActorRestartLoop", "EngineKVCacheFull", "EngineHighErrorRate"} <= set(queries)
    assert unexported(list(queries.values()), series) == {}
