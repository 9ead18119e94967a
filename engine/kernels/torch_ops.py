"""Pointwise pieces of the decoder in plain torch: RMSNorm, rotary embedding, SwiGLU.

Each matches the Hugging Face reference arithmetic (same operations, same order) so that float32
results agree to the last few ulps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F

from engine.kernels.packed_weights import PACKED_WEIGHT_LIMIT


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 (as HF does for half types)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return normed * weight


def rms_norm_per_head(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head vector of x [tokens, heads, head_dim]; weight [heads, head_dim]
    (lets q and k, with different weights, be normalised in one call)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [tokens, 1, head_dim / 2] for the given positions, computed in float32."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by position, "rotate half" layout (GPT-NeoX / HF)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, where gate_up holds [gate | up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (the first of equal ones; a NaN counts as largest):
    greedy sampling's pick over logits [rows, vocab]."""
    return x.argmax(dim=-1)


# Packing a CPU weight for oneDNN costs a second copy of it, up to PACKED_WEIGHT_LIMIT (counted in
# the memory plan: placement.packed_weight_bytes). Worth it for the vocabulary projection: the
# widest matmul, where sgemm's packing of the weight on every call costs the most; the compiled
# CPU backend packs every matmul, for a kernel of its own in float32 (engine/kernels/cpu/linear.py).
def output_projection(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T for the logits: oneDNN with a pre-packed weight on the CPU where
    available (checked against F.linear once), plain F.linear elsewhere."""
    return packed_linear(weight) or (lambda x: F.linear(x, weight))


def packed_linear(weight: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """(x, bias=None) -> x @ weight.T + bias by oneDNN with the weight packed once, if this CPU
    and torch build have it and it agrees with F.linear; else None."""
    nbytes = weight.numel() * weight.element_size()
    usable = (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and nbytes <= PACKED_WEIGHT_LIMIT
    )
    if not usable:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

        def linear(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            return cast(torch.Tensor, out)

        generator = torch.Generator().manual_seed(0)
        probe = torch.randn(3, weight.shape[1], generator=generator).to(weight.dtype)
        if torch.allclose(linear(probe), F.linear(probe, weight), rtol=1e-2, atol=1e-2):
            return linear
    except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
        pass
    return None
