"""What the HTTP handlers and the admin socket share: the engine, settings, metrics, drain flag."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.http.metrics import ServerMetrics
from engine.settings import Settings
from engine.trace.recorder import TraceRecorder

if TYPE_CHECKING:
    from engine import AsyncLLM


@dataclass
class ServerState:
    llm: AsyncLLM
    settings: Settings
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    started_at: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    trace: TraceRecorder | None = None

    @classmethod
    def create(cls, llm: AsyncLLM, settings: Settings) -> ServerState:
        trace = (
            TraceRecorder(settings.server.record_trace) if settings.server.record_trace else None
        )
        return cls(
            llm=llm,
            settings=settings,
            metrics=ServerMetrics(llm.stats),
            model_name=llm.model_name,
            max_model_len=llm.max_model_len,
            trace=trace,
        )
