"""ModelConfig: what the engine needs from a Hugging Face checkpoint's config.json.

Parsed by hand (no transformers import) so that reading a config costs milliseconds. Which
architectures are supported, and by which family, is the registry's
(engine/model/architectures/registry.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from engine.model.architectures.registry import (
    ARCHITECTURES,
    Architecture,
    supported_architectures_message,
)
from engine.model.rope_config import RopeScaling, parse_rope

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # of the gated MLP: SwiGLU, GeGLU
FULL, SLIDING = "full_attention", "sliding_attention"  # config.json's layer_types


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # e.g. "Qwen3ForCausalLM"
    model_type: str  # e.g. "qwen3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    max_model_len: int  # min(requested, max_position_embeddings)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str | None  # the checkpoint's dtype name ("float32", "bfloat16", ...)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hidden_act: str = "silu"  # one of ACTIVATIONS
    rotary_dim: int = 0  # dimensions of each head that rotate (0: all of head_dim)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' rope base, unscaled
    # Sliding-window attention: a token of a sliding layer sees itself and the sliding_window - 1
    # keys before it. layer_types[i] is FULL or SLIDING (empty: every layer FULL).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits, likewise
    scaled_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    norm_offset: bool = False  # RMSNorm weights are stored as w - 1: (1 + w) applies (Gemma)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma 2 and 3)
    qk_norm_whole: bool = False  # q and k normed over all heads at once (OLMoE)
    fused_checkpoint: bool = False  # the checkpoint holds qkv_proj and gate_up_proj (Phi-3)
    # Mixture of experts (0 experts: a dense MLP in every layer)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = False  # top-k routing weights rescaled to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP in a MoE model

    @property
    def rotary_size(self) -> int:
        return self.rotary_dim or self.head_dim

    def window_of(self, layer: int) -> int | None:
        """Keys a token of `layer` sees at most (itself included); None: all before it."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers


def load_model_config(model_path: str | Path, max_model_len: int | None = None) -> ModelConfig:
    """Read `config.json` (and `generation_config.json` for eos ids) from a checkpoint directory."""
    path = Path(model_path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"no config.json in {str(path)!r}: expected a Hugging Face checkpoint directory"
        )
    raw: dict[str, Any] = json.loads(config_file.read_text())
    generation_file = path / "generation_config.json"
    generation: dict[str, Any] = (
        json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    )
    return parse_model_config(raw, generation, max_model_len=max_model_len, source=str(path))


def parse_model_config(
    raw: dict[str, Any],
    generation: dict[str, Any] | None = None,
    *,
    max_model_len: int | None = None,
    source: str = "config.json",
) -> ModelConfig:
    architecture = _architecture(raw, source)
    flags = ARCHITECTURES[architecture]
    hidden_act = str(raw.get(flags.activation_key) or raw.get("hidden_act") or "silu")
    if hidden_act not in ACTIVATIONS:
        raise ValueError(
            f"{source}: {flags.activation_key} {hidden_act!r} is not supported; "
            f"expected one of {', '.join(ACTIVATIONS)}"
        )
    if raw.get("use_sliding_window", False) and not flags.sliding_window:
        raise ValueError(f"{source}: use_sliding_window=true is not supported; expected false")
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
    attention_bias = bool(raw.get("attention_bias", False))
    rope = parse_rope(raw, source)
    max_positions = int(raw.get("max_position_embeddings", 2048))
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {max_model_len}")
    num_layers = int(raw["num_hidden_layers"])
    scalar = raw.get("query_pre_attn_scalar")
    max_len = min(max_model_len or max_positions, max_positions)
    window = _sliding_window(raw, flags)
    if window is not None and window >= max_len:
        window = None  # no sequence is long enough for the window to hide a key
    return ModelConfig(
        architecture=architecture,
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        max_position_embeddings=max_positions,
        max_model_len=max_len,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", flags.tied_by_default)),
        qkv_bias=attention_bias if flags.qkv_bias is None else flags.qkv_bias,
        o_bias=attention_bias if flags.o_bias is None else flags.o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=flags.qk_norm,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        eos_token_ids=_eos_ids(raw, generation or {}),
        bos_token_id=raw.get("bos_token_id"),
        hidden_act=hidden_act,
        rotary_dim=_rotary_dim(head_dim, rope.rotary_fraction, source),
        local_rope_theta=rope.local_theta if flags.local_rope else None,
        sliding_window=window,
        layer_types=() if window is None else _layer_types(raw, flags, num_layers, source),
        attention_scale=None if scalar is None else float(scalar) ** -0.5,
        attn_logit_softcapping=_optional_float(raw.get("attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping")),
        scaled_embeddings=flags.gemma_norms,
        norm_offset=flags.gemma_norms,
        sandwich_norms=flags.gemma_norms,
        qk_norm_whole=flags.qk_norm_whole,
        fused_checkpoint=flags.fused_checkpoint,
        **_experts(raw, flags, num_layers),
    )


def _architecture(raw: dict[str, Any], source: str) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return str(name)
    raise ValueError(
        f"{source}: unsupported architecture {names!r}; "
        f"supported: {supported_architectures_message()}"
    )


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    value = generation.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _rotary_dim(head_dim: int, fraction: float, source: str) -> int:
    rotary = int(head_dim * fraction)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ValueError(
            f"{source}: partial_rotary_factor {fraction} gives {rotary} rotary dimensions of "
            f"{head_dim}; expected an even number in (0, head_dim]"
        )
    return 0 if rotary == head_dim else rotary


def _sliding_window(raw: dict[str, Any], flags: Architecture) -> int | None:
    window = raw.get("sliding_window")
    if not flags.sliding_window or window is None:
        return None
    if raw.get("use_sliding_window") is False:  # Qwen-style switch beside the size
        return None
    return int(window)


def _layer_types(
    raw: dict[str, Any], flags: Architecture, num_layers: int, source: str
) -> tuple[str, ...]:
    """Each layer's attention: config.json's `layer_types`, else the family's pattern (every
    n-th layer full, the others sliding), else sliding everywhere."""
    listed = raw.get("layer_types")
    if listed is not None:
        types = tuple(str(t) for t in listed)
        if len(types) != num_layers or not set(types) <= {FULL, SLIDING}:
            raise ValueError(
                f"{source}: layer_types must list {num_layers} of {FULL!r} or {SLIDING!r}"
            )
        return types
    every = int(raw.get("sliding_window_pattern") or flags.full_layer_every)
    if every:
        return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers))
    return (SLIDING,) * num_layers


def _experts(raw: dict[str, Any], flags: Architecture, num_layers: int) -> dict[str, Any]:
    count = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if not flags.experts or not count:
        return {}
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    dense |= {i for i in range(num_layers) if (i + 1) % step}
    return {
        "num_experts": count,
        "experts_per_token": int(raw["num_experts_per_tok"]),
        "expert_intermediate_size": int(
            raw.get("moe_intermediate_size") or raw["intermediate_size"]
        ),
        "normalize_expert_weights": bool(raw.get("norm_topk_prob", flags.normalize_experts)),
        "dense_layers": tuple(sorted(dense)),
    }
