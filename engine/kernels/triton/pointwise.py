"""Row-wise pieces of the decoder as Triton kernels: RMSNorm (optionally fused with the
residual add), per-head RMSNorm, rotary embedding, SiLU-and-mul.

Each keeps the torch reference's rounding points (engine/kernels/torch_ops.py): statistics in
float32, the normalised value cast to the model dtype before the weight multiplies it, the
SiLU cast before the product, so bfloat16 results agree with it to about an ulp. Arithmetic
itself is float32 (Triton's interpreter mis-computes bfloat16 operands); a float32 product of
two bfloat16 values is exact, so rounding it once equals torch's bfloat16 multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    stride_x_token,
    stride_x_head,
    stride_residual_token,
    stride_weight_head,
    HEADS: tl.constexpr,  # rows per token: 1, or the heads of a per-head norm
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    token = row // HEADS
    head = row % HEADS
    columns = tl.arange(0, BLOCK)
    mask = columns < N
    x = tl.load(x_ptr + token * stride_x_token + head * stride_x_head + columns, mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    x = x.to(tl.float32)
    if ADD_RESIDUAL:  # the sum is rounded to the model dtype, as the unfused add would be
        residual = tl.load(residual_ptr + token * stride_residual_token + columns, mask, other=0.0)
        x = (x + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * N + columns, x, mask)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    weight = tl.load(weight_ptr + head * stride_weight_head + columns, mask).to(tl.float32)
    out = normed.to(dtype).to(tl.float32) * weight
    tl.store(out_ptr + row * N + columns, out.to(dtype), mask)


def _rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    heads: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x viewed as [tokens, heads, N] (last dimension contiguous)."""
    n = x.shape[-1]
    x3 = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, heads, n)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = None if residual is None else torch.empty_like(out)
    residual_2d = None if residual is None else residual.reshape(-1, n)
    if out.numel():
        _rms_norm_kernel[(x3.shape[0] * heads,)](
            x3,
            residual_2d,
            weight,
            out,
            residual_out,
            eps,
            x3.stride(0),
            x3.stride(1),
            0 if residual_2d is None else residual_2d.stride(0),
            weight.stride(0) if heads > 1 else 0,
            HEADS=heads,
            N=n,
            BLOCK=triton.next_power_of_2(n),
            ADD_RESIDUAL=residual is not None,
        )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension."""
    return _rms_norm(x, None, weight, eps, heads=1)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one pass over the rows."""
    out, summed = _rms_norm(x, residual, weight, eps, heads=1)
    assert summed is not None
    return out, summed


def rms_norm_per_head(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head vector of x [tokens, heads, head_dim]; weight [heads, head_dim]."""
    return _rms_norm(x, None, weight, eps, heads=x.shape[1])[0]


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_x_token,
    stride_x_head,
    stride_cos_token,
    stride_sin_token,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    columns = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < HEADS) & (columns < HALF)
    x = x_ptr + token * stride_x_token + heads * stride_x_head + columns
    x1 = tl.load(x, mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_cos_token + columns, columns < HALF).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin_token + columns, columns < HALF).to(tl.float32)
    out = out_ptr + token * HEADS * 2 * HALF + heads * 2 * HALF + columns
    tl.store(out, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by position ("rotate half" layout); cos and sin
    [tokens, 1, head_dim / 2]."""
    tokens, heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    if tokens:
        _rotary_kernel[(tokens,)](
            x,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            sin.stride(0),
            HEADS=heads,
            HALF=head_dim // 2,
            BLOCK_HEADS=triton.next_power_of_2(heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return out


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_gate_up_token, N: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < N
    gate_pointers = gate_up_ptr + token * stride_gate_up_token + columns
    gate = tl.load(gate_pointers, mask, other=0.0).to(tl.float32)
    up = tl.load(gate_pointers + N, mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * N + columns, (silu * up).to(dtype), mask)


SILU_BLOCK = 1024  # columns per program


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, where gate_up [..., 2N] holds [gate | up]."""
    n = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        block = min(SILU_BLOCK, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
            rows, out, rows.stride(0), N=n, BLOCK=block
        )
    return out
