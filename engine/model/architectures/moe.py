"""The mixture-of-experts family: Qwen3-MoE (q/k head norms), OLMoE (q/k norms over all heads)
and Mixtral (a sliding window where set): pre-norm layers whose MLP is a routed mixture of
experts (engine/model/architectures/experts.py), or a dense MLP in the layers a Qwen3-MoE
config keeps dense.

    for each layer:
        h = h + Attention(RMSNorm(h))
        h = h + MoE(RMSNorm(h))       # top-k of E experts per token
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.kernels.backend import KernelBackend
from engine.model.architectures.decoder import CausalLM
from engine.model.architectures.experts import SparseMoE
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


class MoeDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        ops: KernelBackend,
        shape: RankShape,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, layer, ops, shape, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp: SparseMoE | GatedMLP = (
            SparseMoE(config, ops)
            if config.is_moe_layer(layer)
            else GatedMLP(config, layer, ops, shape, group)
        )

    def fuse_weights(self, prepared: PreparedLinears) -> None:
        self.self_attn.fuse_weights(prepared)
        if isinstance(self.mlp, GatedMLP):
            self.mlp.fuse_weights(prepared)

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), step)
        return cast(torch.Tensor, h + self.mlp(self.post_attention_layernorm(h)))


class MoeForCausalLM(CausalLM):
    def make_layer(
        self,
        config: ModelConfig,
        layer: int,
        ops: KernelBackend,
        shape: RankShape,
        group: TensorParallelGroup,
    ) -> nn.Module:
        return MoeDecoderLayer(config, layer, ops, shape, group)
