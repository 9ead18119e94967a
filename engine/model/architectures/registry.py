"""Which family builds which checkpoint: a Hugging Face `architectures` entry onto the module
under engine/model/architectures/ that implements it, with what the config reader needs to know
about the architecture. Torch-free: the root reads it to check a model before any worker starts.

A GGUF file reaches this table through its Hugging Face name: engine/gguf/hf_config.py turns
the file's `general.architecture` (llama.cpp's name) into the config.json the engine reads.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture: its family module, and how its config.json reads."""

    family: str  # module under engine/model/architectures/ (and key of families.FAMILIES)
    qkv_bias: bool | None = None  # None: read `attention_bias` from config.json
    o_bias: bool | None = None  # None: read `attention_bias`
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # ... over all of q and all of k at once (OLMoE)
    activation_key: str = "hidden_act"  # config.json's name for the MLP's activation
    sliding_window: bool = False  # config.json's `sliding_window` applies
    full_layer_every: int = 0  # without `layer_types`: every n-th layer full, others sliding
    local_rope: bool = False  # sliding layers have a rope base of their own (Gemma 3)
    gemma_norms: bool = False  # (1 + w) norms, four per layer, scaled embeddings
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj whole
    experts: bool = False  # a mixture of experts in place of the MLP
    normalize_experts: bool = False  # without `norm_topk_prob`: renormalise the top-k weights
    tied_by_default: bool = False  # without `tie_word_embeddings` in config.json


def _gemma(full_layer_every: int, qk_norm: bool = False, local_rope: bool = False) -> Architecture:
    return Architecture(
        "gemma",
        qk_norm=qk_norm,
        activation_key="hidden_activation",
        sliding_window=True,
        full_layer_every=full_layer_every,
        local_rope=local_rope,
        gemma_norms=True,
        tied_by_default=True,
    )


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama"),
    "MistralForCausalLM": Architecture("llama", sliding_window=True),
    "MinistralForCausalLM": Architecture("llama", sliding_window=True),
    "Qwen2ForCausalLM": Architecture("llama", qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": Architecture("llama", qk_norm=True),
    "Phi3ForCausalLM": Architecture("llama", sliding_window=True, fused_checkpoint=True),
    "Gemma2ForCausalLM": _gemma(full_layer_every=2),
    "Gemma3ForCausalLM": _gemma(full_layer_every=6, qk_norm=True, local_rope=True),
    "Qwen3MoeForCausalLM": Architecture("moe", qk_norm=True, experts=True),
    "OlmoeForCausalLM": Architecture("moe", qk_norm_whole=True, experts=True),
    "MixtralForCausalLM": Architecture(
        "moe", sliding_window=True, experts=True, normalize_experts=True
    ),
}


def supported_architectures_message() -> str:
    return ", ".join(sorted(ARCHITECTURES))
