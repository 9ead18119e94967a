"""Rotary embedding settings from a config.json: the base, the scaling (linear, Llama 3's,
Phi-3's longrope), how much of each head rotates, and Gemma 3's second base for its sliding
layers. Torch-free, read with the rest of the config (engine/model/config.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear", "llama3" or "longrope"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and longrope
    # longrope (Phi-3): per-frequency divisors for contexts within and beyond the original one
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # cos and sin are scaled by it


@dataclasses.dataclass(frozen=True)
class Rope:
    theta: float
    scaling: RopeScaling | None
    rotary_fraction: float  # of each head's dimensions that rotate (Phi-4-mini: 0.75)
    local_theta: float | None  # Gemma 3's sliding layers: this base, unscaled


def parse_rope(raw: dict[str, Any], source: str) -> Rope:
    """transformers 4's `rope_theta` + `rope_scaling` or transformers 5's `rope_parameters`
    (possibly keyed by layer type: Gemma 3's full and sliding layers differ)."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or {})
    local: dict[str, Any] | None = None
    if isinstance(params.get("full_attention"), dict):
        local = params.get("sliding_attention")
        params = dict(params["full_attention"])
    legacy_scaling = raw.get("rope_scaling")
    if isinstance(legacy_scaling, dict):
        params = {**legacy_scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    fraction = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    local_theta = raw.get("rope_local_base_freq")
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: sliding layers' rope type must be 'default'")
        local_theta = local.get("rope_theta", local_theta)
    scaling = _scaling(params, raw, source)
    return Rope(theta, scaling, fraction, None if local_theta is None else float(local_theta))


def _scaling(params: dict[str, Any], raw: dict[str, Any], source: str) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope type {rope_type!r} is not supported; "
            f"expected one of {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    if rope_type == "longrope":
        return _longrope(params, raw)
    factor = float(params["factor"])
    if rope_type == "linear":
        return RopeScaling("linear", factor)
    return RopeScaling(
        "llama3",
        factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _longrope(params: dict[str, Any], raw: dict[str, Any]) -> RopeScaling:
    """Phi-3's scaling, as transformers computes it: the attention factor defaults to
    sqrt(1 + ln(factor) / ln(original context)), factor = the context over the original one."""
    original = int(
        params.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or raw["max_position_embeddings"]
    )
    factor = float(params.get("factor") or int(raw["max_position_embeddings"]) / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        "longrope",
        factor,
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        attention_factor=float(attention),
    )
