"""One model as the HTTP layer serves it, and the pool of them (engine/catalogue/) that the
server's state holds.

A `ServedModel` is one catalogue entry's engine (an AsyncLLM: its own supervisor and actors),
the root's tokenizer for /tokenize and echo, and its metrics label; the pool starts one when a
request first names the model and stops it when it is idle. Everything a request needs of "the
model" comes from the `ServedModel` its lease holds, never from the server state, so two models
never mix their defaults, limits, adapters or metrics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

from engine.catalogue.entries import CatalogueEntry, build_catalogue
from engine.catalogue.pool import Lease, ModelPool, PoolLimits
from engine.http.metrics import LoadedModel, ServerMetrics
from engine.http.openai.tokens import Tokens
from engine.launch.footprint import least_memory_bytes
from engine.library.chat_tokens import chat_token_ids
from engine.messages.admin import Health
from engine.messages.params import LoRARequest
from engine.model.placement.capacity import available_cpu_memory
from engine.runtime.hooks import install_hooks
from engine.settings import Settings
from engine.settings.durations import parse_keep_alive

if TYPE_CHECKING:
    from engine.library.async_llm import AsyncLLM

ModelLease = Lease["ServedModel"]


class ServedModel:
    def __init__(self, entry: CatalogueEntry, llm: AsyncLLM) -> None:
        self.entry = entry
        self.name = entry.name
        self.llm = llm
        self.tokens: Tokens | None = None  # once started

    async def start(self) -> None:
        await self.llm.start()
        llm, server = self.llm, self.entry.settings.server
        self.tokens = Tokens(
            llm.model_path,
            llm.max_model_len,
            server.allow_special_tokens_in_chat,
            partial(chat_token_ids, llm),
            llm.chat_template,
        )

    async def stop(self, reason: str) -> None:
        await self.llm.shutdown(reason)

    def failure(self) -> str | None:
        return self.llm.health().reason

    def memory_bytes(self) -> int:
        return self.llm.memory_bytes()

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request may use for it: its own, then each LoRA adapter's."""
        adapters = self.llm.adapters
        return self.entry.names + (adapters.names() if adapters is not None else ())

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def chat_template(self) -> str | None:
        return self.llm.chat_template

    def adapter_of(self, model: str) -> LoRARequest | None:
        """The LoRA adapter a request's model name names; None: the base model."""
        adapters = self.llm.adapters
        return adapters.get(model) if adapters is not None else None


def model_pool(settings: Settings) -> ModelPool[ServedModel]:
    """The catalogue of these settings in a pool within their [models] limits."""
    from engine.library.async_llm import AsyncLLM

    models = settings.models
    entries = build_catalogue(settings)
    budget = models.memory if models.memory is not None else _budget_of_machine(entries)

    def make(entry: CatalogueEntry, room: int | None) -> ServedModel:
        llm = AsyncLLM(entry.settings, memory_room=room, owns_run_files=False)
        served = ServedModel(entry, llm)
        install_hooks("served_model", served)  # a test's HTTP faults, if it asked for some
        return served

    def estimate(entry: CatalogueEntry) -> int:
        return least_memory_bytes(entry.settings, budget or available_cpu_memory())

    limits = PoolLimits(
        max_loaded=models.max_loaded,
        memory_budget=budget,
        keep_alive=parse_keep_alive(models.keep_alive),
        max_waiting=models.max_waiting,
        load_timeout=models.load_timeout,
    )
    return ModelPool(entries, make, estimate, limits, memory_now=available_cpu_memory)


def _budget_of_machine(entries: list[CatalogueEntry]) -> int | None:
    """Unset: a one-model server has no budget (as before); a catalogue shares the memory
    available at start, on the CPU."""
    if len(entries) == 1 or entries[0].settings.model.device == "cuda":
        return None
    return available_cpu_memory()


def loaded_models(pool: ModelPool[ServedModel]) -> Iterable[LoadedModel]:
    """What /metrics reads of each loaded model."""
    return [(name, served.llm.stats, served.llm.weight_bytes) for name, served in pool.loaded()]


def pool_health(pool: ModelPool[ServedModel]) -> Health:
    """Ready while every loaded model is; the reason a model the server cannot do without (a
    one-model server's) stopped serving. A model of a catalogue that fails is that model's
    state, not the server's."""
    not_ready: list[str] = []
    reason: str | None = None
    for name, served in pool.loaded():
        health = served.llm.health()
        prefix = f"{name}/" if len(pool.slots) > 1 else ""
        not_ready += [f"{prefix}{actor}" for actor in health.not_ready]
        if health.reason is not None and len(pool.slots) == 1:
            reason = health.reason
    if len(pool.slots) == 1:
        (slot,) = pool.slots.values()
        if slot.state == "failed":
            reason = reason or slot.error
    ready = not not_ready and reason is None and bool(pool.loaded() or len(pool.slots) > 1)
    return Health(ready=ready, not_ready=not_ready, reason=reason)


def metrics_for(pool: ModelPool[ServedModel]) -> ServerMetrics:
    from engine.http.model_metrics import catalogue_families

    return ServerMetrics(
        lambda: loaded_models(pool),
        pool.default_name,
        lambda: catalogue_families(pool.slots.values()),
    )


def request_keep_alive(value: object) -> float | None:
    """A request's keep_alive in seconds (None: it gave none); ValueError naming the form."""
    if value is None:
        return None
    seconds = parse_keep_alive(value)
    return seconds if seconds >= 0 else math.inf
