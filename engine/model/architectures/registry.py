"""Which family builds which checkpoint: a Hugging Face `architectures` entry onto the module
under engine/model/architectures/ that implements it, with the few flags that tell apart the
architectures one family covers. Torch-free: the root reads it to check a model before any
worker starts.

A GGUF file reaches this table through its Hugging Face name: engine/gguf/hf_config.py turns
the file's `general.architecture` (llama.cpp's name) into the config.json the engine reads.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture: its family module, and how it departs from the family's
    plain form."""

    family: str  # module under engine/model/architectures/ (and key of families.FAMILIES)
    qkv_bias: bool | None = None  # None: read `attention_bias` from config.json
    o_bias: bool | None = None  # None: read `attention_bias`
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama"),
    "Qwen2ForCausalLM": Architecture("llama", qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": Architecture("llama", qk_norm=True),
}


def supported_architectures_message() -> str:
    return ", ".join(sorted(ARCHITECTURES))
