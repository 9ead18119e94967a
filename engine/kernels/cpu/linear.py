"""The compiled CPU backend's matmuls of the decoder: each weight packed once for oneDNN (a second
copy of it, made while a rank's decoder weights take at most PACKED_DECODER_LIMIT and counted by
the memory plan: engine/packed_weights.py), used by steps of two tokens or more. oneDNN's call
costs ~35 us more than F.linear's, which a single token's matmul does not win back; from two
tokens on MKL's small-batch path is slower (measured over the demo model's 16 decoder matmuls on
2 threads: 1 token 1.38 ms F.linear, 1.56 ms packed; 4 tokens 2.63 against 2.06 ms; 32 tokens
3.70 against 3.18 ms; a decode step of 32 x 1,024 keys 19.3 -> 17.3 ms, in-process A/B)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import torch_ops
from engine.kernels.backend import Linear

PACKED_FROM_TOKENS = 2


def linear_for(weight: torch.Tensor) -> Linear:
    """x, weight, bias -> x @ weight.T + bias for this (loaded) weight."""
    packed = torch_ops.packed_linear(weight)
    if packed is None:  # not a CPU weight, an unsupported dtype, or no oneDNN in this torch
        return F.linear

    def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] < PACKED_FROM_TOKENS or w is not weight:
            return F.linear(x, w, bias)
        return packed(x, bias)

    return linear
