"""A mixture-of-experts MLP (Qwen3-MoE, OLMoE, Mixtral): a router picks each token's top-k of
E SwiGLU experts and its output is their outputs weighed by the routing weights.

    probs = softmax(router(x))                # over the E experts, in float32
    w, e = top_k(probs)                       # normalised to sum to 1 where the family says
    y = sum over k of w_k * down_e(silu(gate_e(x)) * up_e(x))

Only the experts some token of the step picked run, each once for all the tokens routed to it
(one matmul pair over those rows), in expert order, as transformers adds them up. The experts'
weights are two stacked parameters, gate|up [E * 2I, hidden] and down [E * hidden, I], which
the loader fills expert by expert at row offsets (engine/model/loading/weight_names.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.backend import KernelBackend
from engine.model.config import ModelConfig


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.num_experts = config.num_experts
        self.top_k = config.experts_per_token
        self.normalize = config.normalize_expert_weights
        self.size, hidden = config.expert_intermediate_size, config.hidden_size
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)  # the router
        self.experts = Experts(self.num_experts, hidden, self.size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [tokens, k] and their weights [tokens, k] (x's dtype)."""
        logits = self.ops.linear(x, self.gate.weight, None)
        weights, experts = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.flatten()
        picks = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        gate_up, down = self.experts.stacked()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = picks[start : start + count]
            start += count
            tokens = pairs // self.top_k
            hidden = self.ops.silu_and_mul(self.ops.linear(x[tokens], gate_up[expert], None))
            routed = self.ops.linear(hidden, down[expert], None)
            out.index_add_(0, tokens, routed * weights.view(-1)[pairs, None])
        return out


class Experts(nn.Module):
    """The E experts' weights, stacked: gate_up [E * 2I, hidden] (each expert's gate rows, then
    its up rows) and down [E * hidden, I]."""

    def __init__(self, num_experts: int, hidden: int, size: int) -> None:
        super().__init__()
        self.shape = (num_experts, hidden, size)
        self.gate_up = nn.Parameter(torch.empty(num_experts * 2 * size, hidden))
        self.down = nn.Parameter(torch.empty(num_experts * hidden, size))

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [E, 2I, hidden] and down [E, hidden, I] (views)."""
        num_experts, hidden, size = self.shape
        return (
            self.gate_up.view(num_experts, 2 * size, hidden),
            self.down.view(num_experts, hidden, size),
        )
