"""The model class of each family in the registry (engine/model/architectures/registry.py)."""

from __future__ import annotations

from engine.model.architectures.decoder import CausalLM
from engine.model.architectures.gemma import GemmaForCausalLM
from engine.model.architectures.llama import LlamaForCausalLM
from engine.model.architectures.moe import MoeForCausalLM
from engine.model.architectures.registry import ARCHITECTURES
from engine.model.config import ModelConfig

FAMILIES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "gemma": GemmaForCausalLM,
    "moe": MoeForCausalLM,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    return FAMILIES[ARCHITECTURES[config.architecture].family]
