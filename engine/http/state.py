"""What the HTTP handlers and the admin socket share: the models (the pool of engines, loaded on
demand), settings, metrics, drain flag, the API requests in flight by id, the tenants."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from engine.catalogue.pool import ModelPool
from engine.http.guards import authorize, read_body, sent_key, unauthorized_key
from engine.http.metrics import ServerMetrics
from engine.http.served import ModelLease, ServedModel, metrics_for, model_pool
from engine.http.tenant_metrics import TenantCollector
from engine.request.outputs import EngineError
from engine.settings import Settings
from engine.tenants.directory import Tenants
from engine.tenants.table import EVERYONE, Tenant
from engine.trace.recorder import TraceRecorder


@dataclass
class ServerState:
    models: ModelPool[ServedModel]
    settings: Settings
    metrics: ServerMetrics
    started_at: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    trace: TraceRecorder | None = None
    # The API requests in flight by X-Request-Id: RequestRuns (runs.py imports this module)
    runs: dict[str, Any] = field(default_factory=dict)
    # Who a request runs for, by its API key (engine/tenants/): one tenant without a file.
    tenants: Tenants = field(default_factory=Tenants)

    @property
    def model_name(self) -> str:
        """The model a request that names none gets: the catalogue's first."""
        return self.models.default_name

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every model name a request may use: each model's and alias, loaded or not, then
        each loaded model's LoRA adapters."""
        adapters = [
            name
            for _, served in self.models.loaded()
            for name in served.names[len(served.entry.names) :]
        ]
        return self.models.names() + tuple(adapters)

    def base_of(self, model: str) -> str:
        """The catalogue model a request's model name runs on (an adapter: its base's)."""
        canonical = self.models.canonical(model)
        if canonical is not None:
            return canonical  # an alias's metrics and lease are its model's
        for name, served in self.models.loaded():
            if model in served.names:
                return name
        return model  # unknown: acquire() refuses it, naming the models there are

    async def acquire(self, model: str | None, keep_alive: float | None = None) -> ModelLease:
        """A lease on the model a request names (loaded first if need be); EngineError if the
        server is draining or the model cannot be had."""
        if self.draining:
            raise EngineError("the server is shutting down", 503)
        return await self.models.acquire(self.base_of(model or self.model_name), keep_alive)

    def primary(self) -> ServedModel:
        """The default model, for the routes that name no model (LoRA loading): loaded."""
        slot = self.models.slots[self.model_name]
        if slot.engine is None:
            raise EngineError(f"model '{slot.name}' is not loaded", 503)
        return slot.engine

    @property
    def recording(self) -> bool:
        """--record-trace is on and its recorder takes requests."""
        return self.trace is not None and self.trace.active

    def authorize(self, request: Request, *, x_api_key: bool = False) -> Tenant:
        """The tenant the request's API key names: with a tenants file, the key's (ApiError
        401 for a key it does not hold); else the one tenant, once the request carries the one
        key where the server has one (guards.authorize)."""
        if not self.tenants.enabled:
            authorize(request, self.settings.server.api_key, x_api_key=x_api_key)
            return EVERYONE
        tenant = self.tenants.find(sent_key(request, x_api_key=x_api_key))
        if tenant is None:
            raise unauthorized_key()
        return tenant

    async def read_body(self, request: Request) -> bytes:
        """The body under server.max_request_bytes (guards.read_body)."""
        limit = self.settings.server.max_request_bytes
        return await read_body(request, limit, "server.max_request_bytes")

    @classmethod
    def create(cls, settings: Settings) -> ServerState:
        record = settings.server.record_trace
        deterministic = settings.model.deterministic
        trace = TraceRecorder(record, deterministic=deterministic) if record else None
        pool = model_pool(settings)
        tenants = Tenants(settings.server.api_keys_file)
        metrics = metrics_for(pool)
        if tenants.enabled:
            metrics.registry.register(TenantCollector(tenants))
        return cls(models=pool, settings=settings, metrics=metrics, trace=trace, tenants=tenants)
