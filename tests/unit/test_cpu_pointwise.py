"""The compiled CPU backend's pointwise kernels (engine/kernels/cpu/pointwise.cpp) against the torch
versions they replace (engine/kernels/torch_ops.py, the Hugging Face arithmetic): RMSNorm of
hidden rows and of each head, rotary embedding and SwiGLU, in float32, bfloat16 and float16, on
the strided views the decoder passes them; and greedy sampling's argmax against torch.argmax."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import torch_ops
from engine.kernels.cpu import pointwise

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 to float rounding (a different summation order); half types to one unit in the
    last place of the dtype."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    else:
        ulp = torch.finfo(got.dtype).eps * want.float().abs().clamp(min=1.0)
        close = (got.float() - want.float()).abs() <= ulp
        assert bool((close | (got.isnan() & want.isnan())).all())


def qkv_rows(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A qkv projection's output: the q and k heads are a strided view of its rows."""
    generator = torch.Generator().manual_seed(tokens * 31 + heads)
    return torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 256), (32, 256), (7, 300), (5, 12)])
def test_rms_norm_of_hidden_rows(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    generator = torch.Generator().manual_seed(hidden)
    x = (torch.randn(tokens, hidden, generator=generator) * 3).to(dtype)
    weight = torch.randn(hidden, generator=generator).to(dtype)
    assert_matches(pointwise.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (8, 1, 128), (3, 3, 12)])
def test_rms_norm_of_each_head_of_a_strided_view(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    qkv = qkv_rows(9, heads, kv_heads, dim, dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(9, heads + kv_heads, dim)
    generator = torch.Generator().manual_seed(dim * 7 + heads)  # as qkv_rows: same draw each run
    weight = torch.randn(heads + kv_heads, dim, generator=generator).to(dtype)
    got = pointwise.rms_norm_per_head(qk, weight, 1e-6)
    assert_matches(got, torch_ops.rms_norm_per_head(qk, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "dim"), [(6, 64), (2, 128), (3, 8)])
def test_rotary_of_a_strided_view(dtype: torch.dtype, heads: int, dim: int) -> None:
    qkv = qkv_rows(11, heads, 1, dim, dtype)
    x = qkv[:, : heads * dim].view(11, heads, dim)
    positions = torch.tensor([0, 1, 2, 15, 16, 17, 500, 1023, 1024, 4000, 8191])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = torch_ops.rotary_cos_sin(positions, inv_freq, dtype)
    assert_matches(pointwise.apply_rotary(x, cos, sin), torch_ops.apply_rotary(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "width"), [(1, 768), (32, 768), (3, 77)])
def test_silu_and_mul(dtype: torch.dtype, tokens: int, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(tokens, 2 * width, generator=generator) * 6).to(dtype)
    # exp's edges: silu of -100 is -0 (exp(100) is past float16's range), of 100 is 100; NaN stays
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, float("nan")])
    assert_matches(pointwise.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up))


def test_large_tensors_and_other_layouts_take_the_torch_ops() -> None:
    """Past SMALL_ELEMENTS (a long prefill chunk) and on a layout the kernels do not take, the
    result is the torch op's, exactly."""
    rows = pointwise.SMALL_ELEMENTS // 64 + 1
    x = torch.randn(rows, 64)
    weight = torch.randn(64)
    assert torch.equal(pointwise.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6))
    heads_apart = torch.randn(4, 8, 3).transpose(1, 2)  # [4, 3 heads, 8]: heads not side by side
    per_head = torch.randn(3, 8)
    assert torch.equal(
        pointwise.rms_norm_per_head(heads_apart, per_head, 1e-6),
        torch_ops.rms_norm_per_head(heads_apart, per_head, 1e-6),
    )


@pytest.mark.parametrize(("rows", "cols"), [(1, 8192), (32, 8192), (5, 151_936), (3, 1), (4, 37)])
def test_argmax_of_each_row(rows: int, cols: int) -> None:
    generator = torch.Generator().manual_seed(rows * cols)
    logits = torch.randn(rows, cols, generator=generator)
    assert torch.equal(pointwise.argmax_rows(logits), logits.argmax(dim=-1))


def test_argmax_takes_the_first_of_equal_maxima_and_the_first_nan_as_torch_does() -> None:
    cols = 100  # lanes of 8 and 32, and a tail of 4
    logits = torch.zeros(8, cols)
    logits[0, [3, 40, 99]] = 5.0  # ties: the first
    logits[1, [97, 98]] = 5.0  # in the tail only
    logits[2, :] = float("-inf")  # all -inf: column 0
    logits[3, [10, 60]] = float("nan")  # NaN beats every number
    logits[3, 5] = float("inf")
    logits[4, 99] = float("nan")  # a NaN in the tail
    logits[5, 50] = float("inf")
    logits[6, 0] = -0.0  # -0.0 == +0.0: the first
    logits[7] = torch.arange(cols, 0, -1, dtype=torch.float32)  # the largest in column 0
    assert pointwise.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert pointwise.argmax_rows(logits).tolist() == [3, 97, 0, 10, 99, 50, 0, 0]


def test_argmax_of_a_view_that_drops_columns_and_of_layouts_it_does_not_take() -> None:
    """The sampler passes logits[:, :vocab] (rows a stride apart); other dtypes and layouts go
    to torch.argmax."""
    generator = torch.Generator().manual_seed(7)
    padded = torch.randn(6, 72, generator=generator)
    padded[:, 64:] = 100.0  # padding columns that must not be picked
    view = padded[:, :64]
    assert torch.equal(pointwise.argmax_rows(view), view.argmax(dim=-1))
    for other in (view.to(torch.bfloat16), view.t(), view.to(torch.float64)):
        got = pointwise.argmax_rows(other)
        assert got.dtype == torch.int64 and torch.equal(got, other.argmax(dim=-1))
