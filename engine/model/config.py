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

from engine.model.architectures.registry import ARCHITECTURES, supported_architectures_message

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


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
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"{source}: hidden_act {hidden_act!r} is not supported; expected 'silu'")
    if raw.get("use_sliding_window", False):
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
    rope_theta, rope_scaling = _rope(raw, source)
    max_positions = int(raw.get("max_position_embeddings", 2048))
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {max_model_len}")
    return ModelConfig(
        architecture=architecture,
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        max_model_len=min(max_model_len or max_positions, max_positions),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if flags.qkv_bias is None else flags.qkv_bias,
        o_bias=attention_bias if flags.o_bias is None else flags.o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=flags.qk_norm,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        eos_token_ids=_eos_ids(raw, generation or {}),
        bos_token_id=raw.get("bos_token_id"),
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


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either transformers 4's `rope_theta` + `rope_scaling` or
    transformers 5's `rope_parameters` (possibly keyed by layer type)."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    legacy_scaling = raw.get("rope_scaling")
    if isinstance(legacy_scaling, dict):
        params = {**legacy_scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope type {rope_type!r} is not supported; "
            f"expected one of {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return theta, None
    factor = float(params["factor"])
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    return theta, RopeScaling(
        "llama3",
        factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    value = generation.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
