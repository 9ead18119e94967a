"""The compiled CPU backend's float32 matmul (engine/kernels/cpu/linear.cpp) against x @ W.T + b
computed in float64: tiles of 1-6 rows, blocks of 192 rows, panels of 16 columns with a partial
last one, strided input rows, bias, one and two threads; and the inputs it leaves to F.linear."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import linear
from engine.kernels.registry import select_backend


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 32, 197, 400])
@pytest.mark.parametrize(("n", "k"), [(16, 13), (37, 256), (96, 768)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_a_float64_matmul(threads: int, rows: int, n: int, k: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=generator)
    b = torch.randn(n, generator=generator) if bias else None
    x = torch.randn(rows, k, generator=generator)
    kernel = linear.panel_linear(weight)
    assert kernel is not None
    got = kernel(x, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(x, weight, b), rtol=1e-5, atol=1e-4)


def test_rows_of_a_wider_matrix_and_the_same_bits_for_any_batch_and_thread_count() -> None:
    """Input rows a stride apart (a view); each output is summed by one thread in one order, so
    two threads give the bits one thread does, and a row alone the bits it has in a batch."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 64, generator=generator)
    wide = torch.randn(50, 100, generator=generator)
    x = wide[:, 10:74]
    kernel = linear.panel_linear(weight)
    assert kernel is not None and x.stride(0) == 100
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x)
        torch.set_num_threads(2)
        two = kernel(x)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, reference(x, weight, None), rtol=1e-5, atol=1e-4)
    assert torch.equal(one, two)
    for row in (0, 7, 49):  # in a 6-row tile, in the last (2-row) tile
        assert torch.equal(kernel(x[row : row + 1])[0], one[row])


def test_inputs_it_does_not_take_go_to_f_linear() -> None:
    """A layout or dtype the kernel does not read goes to F.linear: its result, or its error
    (never the kernel reading memory as the wrong type or past a tensor's end)."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(24, 32, generator=generator)
    x = torch.randn(5, 32, generator=generator)
    kernel = linear.panel_linear(weight)
    assert kernel is not None
    columns = torch.randn(32, 5, generator=generator).t()  # a row's elements not adjacent
    assert torch.equal(kernel(columns), F.linear(columns, weight))
    for bad in (
        (x.double(), None),  # float64 input
        (x, torch.randn(24, generator=generator, dtype=torch.float64)),  # float64 bias
        (x, torch.randn(25, generator=generator)),  # a bias of the wrong length
        (torch.randn(5, 31, generator=generator), None),  # rows of the wrong width
    ):
        with pytest.raises(RuntimeError):
            kernel(*bad)
    assert kernel(x[:0]).shape == (0, 24)
    for other in (weight.to(torch.bfloat16), weight.to(torch.float16), torch.empty(0, 32)):
        assert linear.panel_linear(other) is None


def test_the_cpu_backends_matmuls_use_it_for_float32() -> None:
    """The decoder's prepared linear (at 1 row too) and the vocabulary projection: x @ W.T + b;
    a weight the linear was not prepared for goes to F.linear."""
    backend = select_backend("cpu", "cpu")
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(1000, 64, generator=generator)
    b = torch.randn(1000, generator=generator)
    prepared = backend.prepared_linear(weight)
    project = backend.output_projection(weight)
    for rows in (1, 2, 64):
        x = torch.randn(rows, 64, generator=generator)
        torch.testing.assert_close(prepared(x, weight, b), reference(x, weight, b))
        torch.testing.assert_close(project(x), reference(x, weight, None))
    other = torch.randn(1000, 64, generator=generator)
    assert torch.equal(prepared(x, other, b), F.linear(x, other, b))
