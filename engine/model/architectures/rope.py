"""Rotary position embedding frequencies (RoFormer), with linear, Llama 3 and Phi-3's longrope
context scaling, over the rotating part of each head (`ModelConfig.rotary_size`)."""

from __future__ import annotations

import math

import torch

from engine.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary dimensions / 2] in float32: theta^(-2i/d), rescaled per
    `rope_scaling`; `local`: the sliding layers' own base, unscaled (Gemma 3)."""
    dim = config.rotary_size
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    if local:
        assert config.local_rope_theta is not None
        return 1.0 / (config.local_rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        # The long factors where the served context reaches past the original one (as llama.cpp
        # decides, by the context size: a sequence's frequencies never change as it grows).
        long = config.max_model_len > scaling.original_max_position_embeddings
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor)
        return 1.0 / (factors * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        # Dividing frequencies by the factor = dividing positions by it (position interpolation).
        return inv_freq / scaling.factor
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_scale(config: ModelConfig) -> float:
    """The factor cos and sin are multiplied by (longrope's attention factor; else 1)."""
    scaling = config.rope_scaling
    return scaling.attention_factor if scaling is not None else 1.0
