"""What each architecture's GGUF metadata adds to the config.json that engine/gguf/hf_config.py
builds: the keys llama.cpp's converter writes for it, read the way llama.cpp reads them.

- gemma2 / gemma3: GeGLU; soft-caps (gemma2); the sliding window (gemma2's 4096 when the file
  has none), every 2nd (gemma2) or 6th (gemma3) layer global; gemma3's local rope base; the
  attention scale llama.cpp uses (head_dim^-0.5, or (hidden / heads)^-0.5 for the 27B shapes);
- phi3: partial rotary from the rope dimension count, the window (0: none), longrope's factors
  from the rope_factors_long/short tensors;
- experts (qwen3moe, olmoe, and llama files with experts: Mixtral): counts and sizes, and the
  routing normalisation llama.cpp applies (qwen3moe and Mixtral renormalise, OLMoE does not).
"""

from __future__ import annotations

from typing import Any

from engine.gguf.metadata import GGUFError
from engine.gguf.reader import GGUFFile

# GGUF `general.architecture` -> the Hugging Face class the engine's families implement.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's exception to head_dim^-0.5
_RENORMALISED = {"llama": True, "qwen3moe": True, "olmoe": False}


def family_config(gguf: GGUFFile, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """The keys this architecture adds to (or changes in) the file's base `config`."""
    extra: dict[str, Any] = {}
    if arch in _GEMMA_27B_LAYERS:
        extra |= _gemma(gguf, arch, config)
    if arch == "phi3":
        extra |= _phi3(gguf, config)
    if int(gguf.metadata.get(f"{arch}.expert_count") or 0) > 0:
        extra |= _experts(gguf, arch, config)
    return extra


def _gemma(gguf: GGUFFile, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    meta = gguf.metadata
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    scalar = config["head_dim"]
    if layers == _GEMMA_27B_LAYERS[arch]:
        scalar = config["hidden_size"] // heads
    window = meta.get(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else None)
    extra: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": None if not window else int(window),
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
    }
    if arch == "gemma2":
        extra["attn_logit_softcapping"] = meta.get("gemma2.attn_logit_softcapping")
    else:
        extra["rope_local_base_freq"] = float(meta.get("gemma3.rope.freq_base_swa", 10000.0))
    return extra


def _phi3(gguf: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    meta = gguf.metadata
    rotary = int(meta.get("phi3.rope.dimension_count") or config["head_dim"])
    window = int(meta.get("phi3.attention.sliding_window") or 0)
    extra: dict[str, Any] = {
        "partial_rotary_factor": rotary / config["head_dim"],
        "sliding_window": window or None,
    }
    if "rope_factors_long.weight" in gguf.tensors:
        original = meta.get("phi3.rope.scaling.original_context_length")
        if original is None:
            raise GGUFError(f"{gguf.path}: longrope factors without an original context length")
        extra["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": gguf.tensor("rope_factors_long.weight").tolist(),
            "short_factor": gguf.tensor("rope_factors_short.weight").tolist(),
            "original_max_position_embeddings": int(original),
            "attention_factor": float(meta.get("phi3.rope.scaling.attn_factor", 1.0)),
        }
    return extra


def _experts(gguf: GGUFFile, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    meta = gguf.metadata
    if arch not in _RENORMALISED:
        raise GGUFError(f"{gguf.path}: experts in a {arch} file are not supported")
    size = meta.get(f"{arch}.expert_feed_forward_length") or config["intermediate_size"]
    extra: dict[str, Any] = {
        "num_experts": int(meta[f"{arch}.expert_count"]),
        "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
        "moe_intermediate_size": int(size),
        "norm_topk_prob": _RENORMALISED[arch],
    }
    if arch == "llama":
        extra["architectures"] = ["MixtralForCausalLM"]
    return extra
