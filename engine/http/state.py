"""What the HTTP handlers and the admin socket share: the engine, settings, metrics, drain flag,
the API requests in flight by id, the root's tokenizer, the model's sampling defaults."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from engine.http.metrics import ServerMetrics
from engine.http.openai.tokens import Tokens
from engine.library.chat_tokens import chat_token_ids
from engine.messages.params import LoRARequest
from engine.settings import Settings
from engine.testing.http_faults import HttpFaults
from engine.trace.recorder import TraceRecorder

if TYPE_CHECKING:
    from engine.library.async_llm import AsyncLLM


@dataclass
class ServerState:
    llm: AsyncLLM
    settings: Settings
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    tokens: Tokens
    base_names: tuple[str, ...] = ()  # the base model's names a request may use; first shown
    chat_template: str | None = None  # model.chat_template's text, for chats that bring none
    started_at: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    trace: TraceRecorder | None = None
    # The API requests in flight by X-Request-Id: RequestRuns (runs.py imports this module)
    runs: dict[str, Any] = field(default_factory=dict)
    faults: HttpFaults = field(default_factory=HttpFaults)  # tests' fault injection; off

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every model name a request may use: the base model's, then each LoRA adapter's."""
        adapters = self.llm.adapters
        return self.base_names + (adapters.names() if adapters is not None else ())

    def adapter_of(self, model: str) -> LoRARequest | None:
        """The LoRA adapter a request's model name names; None: the base model."""
        adapters = self.llm.adapters
        return adapters.get(model) if adapters is not None else None

    @classmethod
    def create(
        cls,
        llm: AsyncLLM,
        settings: Settings,
        chat_template: str | None = None,
    ) -> ServerState:
        record = settings.server.record_trace
        deterministic = settings.model.deterministic
        trace = TraceRecorder(record, deterministic=deterministic) if record else None
        names = settings.model.served_name or (llm.model_name,)
        return cls(
            llm=llm,
            settings=settings,
            metrics=ServerMetrics(llm.stats, names[0], llm.weight_bytes),
            model_name=names[0],
            max_model_len=llm.max_model_len,
            base_names=tuple(names),
            tokens=Tokens(
                llm.model_path,
                llm.max_model_len,
                settings.server.allow_special_tokens_in_chat,
                partial(chat_token_ids, llm),
                chat_template,
            ),
            chat_template=chat_template,
            trace=trace,
            faults=HttpFaults.from_environment(os.environ),
        )
