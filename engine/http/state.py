"""What the HTTP handlers and the admin socket share: the engine, settings, metrics, drain flag."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

import msgspec

from engine.http.metrics import ServerMetrics
from engine.settings import Settings

if TYPE_CHECKING:
    from engine import AsyncLLM


class TraceWriter:
    """Appends one JSON line per finished API request (server.record_trace)."""

    def __init__(self, path: str) -> None:
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(msgspec.json.encode(record) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class ServerState:
    llm: AsyncLLM
    settings: Settings
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    started_at: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    trace: TraceWriter | None = None

    @classmethod
    def create(cls, llm: AsyncLLM, settings: Settings) -> ServerState:
        trace = TraceWriter(settings.server.record_trace) if settings.server.record_trace else None
        return cls(
            llm=llm,
            settings=settings,
            metrics=ServerMetrics(llm.stats),
            model_name=llm.model_name,
            max_model_len=llm.max_model_len,
            trace=trace,
        )
