"""The compiled CPU backend's pointwise steps: RMSNorm, rotary embedding and SwiGLU as one C++ call
each (pointwise.cpp) for the small tensors of decode steps, where torch's several small ops per
step cost more in dispatch than in arithmetic. Larger tensors, and layouts the kernels do not
take, go to the torch versions (engine/kernels/torch_ops.py), which the kernels match. Also
greedy sampling's argmax over float32 logits, where torch's reduction keeps an index beside every
value it compares and runs far below memory bandwidth."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import torch_ops
from engine.kernels.cpu.attention import DTYPE_CODES
from engine.kernels.cpu.build import load_library

# Up to this many elements the single-threaded kernel runs; above it torch's ops, which split
# the work over the rank's threads and whose dispatch cost no longer matters (a 256-token
# prefill chunk of a 256-wide model is 65,536).
SMALL_ELEMENTS = 1 << 16


def _small(x: torch.Tensor) -> bool:
    return 0 < x.numel() <= SMALL_ELEMENTS and x.device.type == "cpu" and x.dtype in DTYPE_CODES


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[tokens, heads, dim] with each token's heads side by side (rows of a wider matrix)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"the CPU {name} kernel failed (status {status})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As torch_ops.rms_norm, for x [tokens, hidden]: one "head" per token, one shared weight."""
    if x.dim() == 2 and x.stride(1) == 1 and weight.dim() == 1:
        out = _rms_norm_of_heads(x.unsqueeze(1), weight, 0, eps)
        if out is not None:
            return out.view(x.shape)
    return torch_ops.rms_norm(x, weight, eps)


def rms_norm_per_head(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As torch_ops.rms_norm_per_head, for x [tokens, heads, head_dim]; weight [heads, head_dim]."""
    out = None
    if x.dim() == 3 and weight.shape == x.shape[1:]:
        out = _rms_norm_of_heads(x, weight, x.shape[2], eps)
    return torch_ops.rms_norm_per_head(x, weight, eps) if out is None else out


def _rms_norm_of_heads(
    x: torch.Tensor, weight: torch.Tensor, weight_head_stride: int, eps: float
) -> torch.Tensor | None:
    """The kernel's RMSNorm of each head vector of x [tokens, heads, dim] (weight row h at
    h * weight_head_stride); None where it does not take x."""
    usable = _small(x) and _heads_contiguous(x) and weight.is_contiguous()
    if not usable or weight.dtype != x.dtype:
        return None
    tokens, heads, dim = x.shape
    out = x.new_empty(tokens, heads, dim)
    status = load_library().engine_rms_norm(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        tokens,
        heads,
        dim,
        weight.data_ptr(),
        weight_head_stride,
        ctypes.c_float(eps),
        out.data_ptr(),
    )
    _check(status, "RMSNorm")
    return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """As torch_ops.apply_rotary, for x [tokens, heads, head_dim] and cos, sin [tokens, 1,
    head_dim / 2] (torch_ops.rotary_cos_sin)."""
    tokens = x.shape[0]
    half = x.shape[-1] // 2
    usable = (
        _small(x)
        and _heads_contiguous(x)
        and all(
            t.is_contiguous() and t.dtype == x.dtype and t.numel() == tokens * half
            for t in (cos, sin)
        )
    )
    if not usable:
        return torch_ops.apply_rotary(x, cos, sin)
    _, heads, dim = x.shape
    out = x.new_empty(tokens, heads, dim)
    status = load_library().engine_rotary(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        tokens,
        heads,
        dim,
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
    )
    _check(status, "rotary embedding")
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """As torch_ops.silu_and_mul, for gate_up [tokens, 2 * width]."""
    if not (_small(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous()):
        return torch_ops.silu_and_mul(gate_up)
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(tokens, width)
    status = load_library().engine_silu_and_mul(
        DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), tokens, width, out.data_ptr()
    )
    _check(status, "SwiGLU")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """As torch_ops.argmax_rows, for float32 logits [rows, vocab] whose rows are contiguous (any
    row stride: a view that drops padding columns). pointwise.cpp says why it beats torch's."""
    usable = (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.numel() > 0
        and x.stride(1) == 1
    )
    if not usable:
        return torch_ops.argmax_rows(x)
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    library = load_library()
    status = library.engine_argmax_rows(x.data_ptr(), rows, cols, x.stride(0), out.data_ptr())
    _check(status, "argmax")
    return out
