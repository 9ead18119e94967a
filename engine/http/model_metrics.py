"""/metrics for the catalogue (engine/catalogue/): how many models are loaded, and each model's
state, loads, unloads, load time and memory, labelled `model_name` like every other family, so
a dashboard's model selector (deploy/grafana/) lists every model the server knows."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.catalogue.pool import Slot

PREFIX = "engine:"


def catalogue_families(slots: Iterable[Slot]) -> list[Metric]:  # type: ignore[type-arg]
    slots = list(slots)
    label = ["model_name"]
    loaded = GaugeMetricFamily(PREFIX + "loaded_models", "Models loaded now (their actors started)")
    loaded.add_metric([], float(sum(slot.engine is not None for slot in slots)))
    state = GaugeMetricFamily(
        PREFIX + "model_loaded",
        "1 while the model is loaded, else 0 (also while it loads or unloads)",
        labels=label,
    )
    loads = CounterMetricFamily(PREFIX + "model_loads", "Loads of each model", labels=label)
    unloads = CounterMetricFamily(
        PREFIX + "model_unloads", "Unloads of each model (idle, keep_alive, by hand)", labels=label
    )
    seconds = CounterMetricFamily(
        PREFIX + "model_load_seconds",
        "Seconds spent loading each model, over its loads (divide by model_loads)",
        labels=label,
    )
    memory = GaugeMetricFamily(
        PREFIX + "model_memory_bytes",
        "Bytes of each loaded model's weights and KV caches, all ranks (0: not loaded)",
        labels=label,
    )
    for slot in slots:
        name = [slot.name]
        state.add_metric(name, 1.0 if slot.state == "loaded" else 0.0)
        loads.add_metric(name, float(slot.loads))
        unloads.add_metric(name, float(slot.unloads))
        seconds.add_metric(name, slot.load_seconds)
        memory.add_metric(name, float(slot.memory))
    return [loaded, state, loads, unloads, seconds, memory]
