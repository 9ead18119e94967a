"""Tensor-parallel layers (Megatron-style); with a group of one each is its plain torch layer.

- A column-parallel linear is a plain nn.Linear over this rank's output rows: its output stays
  split (heads, MLP columns) and needs no communication, so the decoder uses nn.Linear for it.
- RowParallelLinear: this rank's input columns; partial outputs are summed over the ranks, and
  the bias is added once, after the sum.
- VocabParallelEmbedding: this rank's vocabulary rows; ids outside them give zero rows, and the
  sum over the ranks is the full lookup.
- The LM head multiplies by this rank's vocabulary rows and gathers the logit columns on rank 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.backend import Linear
from engine.model.parallel.group import TensorParallelGroup
from engine.model.quantized import layers as quantized_layers


class RowParallelLinear(nn.Linear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: TensorParallelGroup,
        linear: Linear = F.linear,  # the kernel backend's (batch-invariant in deterministic mode)
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.group = group
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.linear(x, self.weight, self.bias)
        out = self.group.all_reduce(self.linear(x, self.weight, None))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the vocabulary (the tail of the last
    shard may be padding, never looked up)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, vocab_start: int, group: TensorParallelGroup
    ) -> None:
        # An uninitialised weight (the loader fills it): nn.Embedding's random init on the meta
        # device runs through torch._refs, whose first use imports torch._dynamo (a large import
        # that every worker start and restart would pay).
        super().__init__(
            num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim)
        )
        self.vocab_start = vocab_start
        self.group = group
        # The table kept quantized (engine/model/quantized/layers.py; one rank only): the
        # lookup decodes just the rows asked for, and `weight` is an empty placeholder.
        self.quantized: Any = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return quantized_layers.embedding(self.quantized, ids, self.weight.dtype)
        if self.group.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(rows)
