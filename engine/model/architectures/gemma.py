"""The Gemma family (Gemma 2, Gemma 3 text): the shared attention and a GeGLU MLP, each between
two norms, embeddings scaled by sqrt(hidden).

    h = embed(tokens) * sqrt(hidden)
    for each layer:                    # sliding-window and global layers alternate
        h = h + RMSNorm(Attention(RMSNorm(h)))   # Gemma 2: soft-capped scores;
                                                 # Gemma 3: q/k head norms, a local rope base
        h = h + RMSNorm(GeGLU-MLP(RMSNorm(h)))
    logits = softcap(embed^T RMSNorm(h))           # Gemma 2 caps the logits too

Gemma's norms scale by (1 + w): the loader adds the 1 to the stored weights of a Hugging Face
checkpoint (llama.cpp's converter already did in a GGUF file), so RMSNorm is the shared one.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.kernels.backend import KernelBackend
from engine.model.architectures.decoder import CausalLM
from engine.model.architectures.layers import (
    Attention,
    GatedMLP,
    PreparedLinears,
    RMSNorm,
    StepContext,
)
from engine.model.config import ModelConfig
from engine.model.parallel.group import TensorParallelGroup
from engine.model.parallel.layout import RankShape


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        ops: KernelBackend,
        shape: RankShape,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.self_attn = Attention(config, layer, ops, shape, group)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, ops)
        self.mlp = GatedMLP(config, layer, ops, shape, group)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, ops)

    def fuse_weights(self, prepared: PreparedLinears) -> None:
        self.self_attn.fuse_weights(prepared)
        self.mlp.fuse_weights(prepared)

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(h), step)
        h = h + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(h), step.lora)
        return cast(torch.Tensor, h + self.post_feedforward_layernorm(mixed))


class GemmaForCausalLM(CausalLM):
    def make_layer(
        self,
        config: ModelConfig,
        layer: int,
        ops: KernelBackend,
        shape: RankShape,
        group: TensorParallelGroup,
    ) -> nn.Module:
        return GemmaDecoderLayer(config, layer, ops, shape, group)
