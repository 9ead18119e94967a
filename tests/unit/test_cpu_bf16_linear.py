"""The compiled CPU backend's bfloat16 matmul (engine/kernels/cpu/bf16_linear.cpp): every path
this CPU runs (AVX512-BF16's dot products, AVX2's widening FMAs, the scalar reference) gives the
same bits, denormals included; the result is within float32 rounding of a float64 matmul of the
same bfloat16 values; a row's bits do not depend on its batch or the thread count; and inputs
it does not take go to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import bf16_linear
from engine.kernels.registry import select_backend

PATHS = {name: bf16_linear.PATHS[name] for name in bf16_linear.available_paths()}


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b in float64 of the bfloat16 values the kernel reads."""
    out = x.bfloat16().double() @ weight.double().T
    return out if bias is None else out + bias.double()


def by_path(
    kernel: bf16_linear.Bf16Panels, x: torch.Tensor, bias: torch.Tensor | None, out: torch.dtype
) -> dict[str, torch.Tensor]:
    return {name: kernel(x, bias, out, path) for name, path in PATHS.items()}


@pytest.mark.parametrize("rows", [1, 5, 13, 200])
@pytest.mark.parametrize(("n", "k"), [(16, 2), (37, 64), (96, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_path_gives_the_same_bits_close_to_a_float64_matmul(
    rows: int, n: int, k: int, bias: bool
) -> None:
    """Tiles of 1-12 rows and the AVX2 path's widened panels (6 rows and more), a partial last
    panel, float32 or bfloat16 activations and outputs."""
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    b = torch.randn(n, generator=generator) if bias else None
    x = torch.randn(rows, k, generator=generator)
    kernel = bf16_linear.bf16_panels(weight)
    assert kernel is not None and "scalar" in PATHS and "avx2" in PATHS  # any x86 CI machine
    for activations, out in ((x, torch.float32), (x.bfloat16(), torch.bfloat16)):
        results = by_path(kernel, activations, b, out)
        for name, got in results.items():
            assert got.dtype == out and torch.equal(got, results["scalar"]), name
        expected = reference(x, weight, b)
        # k bfloat16 products summed in float32: each step one rounding (2^-24 of the sum)
        bound = k * 2**-23 * (x.abs().double() @ weight.abs().double().T) + 1e-6
        if out == torch.bfloat16:
            bound = bound + expected.abs() * 2**-8  # the output's own rounding
        assert ((results["scalar"].double() - expected).abs() <= bound).all()


def test_denormals_are_flushed_alike_in_every_path() -> None:
    """vdpbf16ps reads denormal inputs as zero and flushes denormal sums: the other paths do
    too, so that products near float32's smallest normal give the same bits everywhere."""
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(32, 64, generator=generator) * 1.3e-19).bfloat16()
    x = (torch.randn(5, 64, generator=generator) * 1e-19).bfloat16()
    weight[3, 5], x[1, 7] = 5e-39, -3e-39  # denormal inputs
    kernel = bf16_linear.bf16_panels(weight)
    assert kernel is not None
    results = by_path(kernel, x, None, torch.float32)
    assert (results["scalar"] != 0).sum() > 50  # sums above the flushing threshold remain
    for name, got in results.items():
        assert torch.equal(got.view(torch.int32), results["scalar"].view(torch.int32)), name


def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 64, generator=generator).bfloat16()
    wide = torch.randn(50, 100, generator=generator).bfloat16()
    x = wide[:, 10:74]  # rows a stride apart
    kernel = bf16_linear.bf16_panels(weight)
    assert kernel is not None
    before = torch.get_num_threads()
    try:
        for name, path in PATHS.items():
            torch.set_num_threads(1)
            one = kernel(x, path=path)
            torch.set_num_threads(2)
            assert torch.equal(kernel(x, path=path), one), name
            for row in (0, 7, 49):
                assert torch.equal(kernel(x[row : row + 1], path=path)[0], one[row]), name
    finally:
        torch.set_num_threads(before)


def test_inputs_it_does_not_take_go_to_f_linear() -> None:
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(24, 32, generator=generator).bfloat16()
    kernel = bf16_linear.bf16_panels(weight)
    assert kernel is not None
    columns = torch.randn(32, 5, generator=generator).bfloat16().t()  # elements not adjacent
    assert torch.equal(kernel(columns), F.linear(columns, weight))
    assert kernel(torch.randn(0, 32).bfloat16()).shape == (0, 24)
    for other in (weight.float(), weight.half(), torch.empty(3, 31, dtype=torch.bfloat16)):
        assert bf16_linear.bf16_panels(other) is None  # float32 has its own kernel; odd k


def test_the_cpu_backends_bfloat16_matmuls_use_it() -> None:
    """The decoder's prepared linear (a few rows: the kernel's bits) and the vocabulary
    projection (float32 logits) of a bfloat16 weight; any other weight goes to F.linear."""
    backend = select_backend("cpu", "cpu")
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(1000, 64, generator=generator).bfloat16()
    b = torch.randn(1000, generator=generator).bfloat16()
    prepared = backend.prepared_linear(weight)
    project = backend.output_projection(weight)
    kernel = bf16_linear.bf16_panels(weight)
    assert kernel is not None
    for rows in (1, 3, 64):
        x = torch.randn(rows, 64, generator=generator).bfloat16()
        expected = reference(x, weight, b)
        got = prepared(x, weight, b)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), expected, atol=0.05, rtol=2**-7)
        if rows < 16:  # oneDNN's packed matmul may take larger steps
            assert torch.equal(got, kernel(x, b))
        logits = project(x)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(
            logits.double(), reference(x, weight, None), atol=0.05, rtol=2**-7
        )
    other = torch.randn(1000, 64, generator=generator).bfloat16()
    assert torch.equal(prepared(x, other, b), F.linear(x, other, b))


def test_a_path_can_be_chosen_for_every_call() -> None:
    """What the environment's ENGINE_BF16_LINEAR_PATH does: calls that ask for no path take the
    chosen one (a CPU without AVX512-BF16 imitated); one this CPU cannot run is refused."""
    weight = torch.randn(48, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    kernel = bf16_linear.bf16_panels(weight)
    assert kernel is not None
    try:
        bf16_linear.choose_path("avx2")
        assert bf16_linear.chosen_path() == "avx2"
        assert torch.equal(kernel(x), kernel(x, path=PATHS["avx2"]))
    finally:
        bf16_linear.choose_path("best")
    # the fastest this build runs: AVX2 in one built without AVX-512 (ENGINE_KERNEL_FLAGS)
    assert bf16_linear.chosen_path() in bf16_linear.available_paths()[-2:]
    with pytest.raises(ValueError, match="path 'amx' does not run on this CPU"):
        bf16_linear.choose_path("amx")
