"""The LoRA settings turned into what the workers and the scheduler start with; the adapters
named at start checked against the base model (a one-line error before any process starts)."""

from __future__ import annotations

from typing import TypedDict

from engine.model.config import ModelConfig
from engine.model.lora.files import AdapterError, check_adapter
from engine.settings.lora_schema import parse_lora_module
from engine.settings.schema import Settings


class LoraWorkerFields(TypedDict, total=False):
    max_lora_rank: int
    max_cpu_loras: int


def lora_worker_fields(settings: Settings, config: ModelConfig) -> LoraWorkerFields:
    """WorkerConfig's LoRA fields (max_lora_rank 0: LoRA off), once every adapter of
    --lora-modules is known to fit the base model (ValueError naming the first that does not)."""
    lora = settings.lora
    if not lora.enable_lora:
        return {}
    for text in lora.lora_modules:
        module = parse_lora_module(text)
        try:
            check_adapter(module.path, config, lora.max_lora_rank)
        except AdapterError as exc:
            raise AdapterError(f"--lora-modules {module.name}: {exc}") from None
    return {"max_lora_rank": lora.max_lora_rank, "max_cpu_loras": lora.cache_size()}


def max_loras_of(settings: Settings) -> int:
    """The scheduler's bound on distinct adapters per step (0: LoRA off, no bound)."""
    return settings.lora.max_loras if settings.lora.enable_lora else 0
