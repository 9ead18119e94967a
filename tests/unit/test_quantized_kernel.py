"""The CPU kernel for quantized weights (engine/kernels/cpu/quantized_linear.cpp, quantized.py)
against references this project did not write: weights quantized by the gguf package (Q4_0, Q4_1,
Q8_0, decoded here into BlockCodes), whose dequantization gguf computes, and a float64 matmul.

Every path this CPU runs (scalar, AVX2, AVX512-VNNI) must stay within the error that rounding the
activations to int8 can cause, give the bits the scalar reference gives, and give a row the same
bits whatever the rows beside it and the thread count."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import pytest
import torch

from engine.kernels.cpu import quantized
from engine.quantization import layout
from engine.quantization.codes import BlockCodes

Q = gguf.GGMLQuantizationType
QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
WIDTHS = [576, 1536, 4096]  # SmolLM2-135M's hidden and MLP widths, and a 7B model's
ROWS = 40  # two full panels and a partial one
BATCH = 64
EPS32 = 2.0**-24  # float32's unit roundoff


# ---- gguf's blocks as BlockCodes ---------------------------------------------------------------


def decode_gguf(raw: npt.NDArray[np.uint8], qtype: Q, rows: int) -> BlockCodes:
    """gguf's Q4_0 (d, 16 bytes of nibbles), Q4_1 (d, m, nibbles) or Q8_0 (d, 32 int8) blocks as
    codes with a scale and a minimum: Q4_0 w = d (u - 8); Q4_1 w = d u + m; Q8_0 w = d (u - 128)."""
    size = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}[qtype]
    blocks = raw.reshape(rows, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == Q.Q8_0:
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return BlockCodes(8, codes.reshape(rows, -1), d, -128 * d, "Q8_0")
    first = 2 if qtype == Q.Q4_0 else 4
    nibbles = blocks[..., first:]  # byte j: value j in the low nibble, value j + 16 in the high
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    if qtype == Q.Q4_0:
        return BlockCodes(4, codes, d, -8 * d, "Q4_0")
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return BlockCodes(4, codes, d, m, "Q4_1")


@functools.cache
def quantized_weight(qtype: Q, k: int, rows: int = ROWS) -> tuple[npt.NDArray[Any], BlockCodes]:
    """gguf's blocks of a random [rows, k] weight, and the same as BlockCodes."""
    generator = np.random.default_rng(k * 100 + int(qtype) * 10 + rows)
    weight = (generator.standard_normal((rows, k)) * 0.05).astype(np.float32)
    weight[:, :32] += 0.02  # a block whose values are all one side of 0: Q4_1's minimum > 0
    raw = gguf.quants.quantize(weight, qtype)
    return raw, decode_gguf(raw, qtype, rows)


@functools.cache
def packed(qtype: Q, k: int) -> quantized.PackedWeight:
    return quantized.pack(quantized_weight(qtype, k)[1])


def activations(k: int, rows: int = BATCH, seed: int = 0) -> torch.Tensor:
    """x [rows, k] as a column slice of a wider matrix (rows a stride apart), with a spread of
    magnitudes across blocks and an all-zero block (dx = 0)."""
    generator = torch.Generator().manual_seed(k + seed)
    wide = torch.randn(rows, k + 13, generator=generator)
    wide[:, 5 : 5 + k] *= torch.linspace(0.1, 3.0, k)
    wide[:, 5 + 64 : 5 + 96] = 0.0
    return wide[:, 5 : 5 + k]


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ---- The weight: gguf's values, the packed layout ----------------------------------------------


@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_block_codes_dequantize_to_ggufs_values(qtype: Q, k: int) -> None:
    raw, codes = quantized_weight(qtype, k)
    expected = gguf.quants.dequantize(raw, qtype)
    assert codes.dequantize().dtype == np.float32
    assert np.array_equal(codes.dequantize(), expected)


def reference_pack(codes: BlockCodes) -> bytes:
    """The layout as layout.py words it, one byte at a time."""
    rows, k = codes.shape
    out = bytearray()
    for panel in range(layout.panels(rows)):
        for block in range(k // layout.BLOCK):
            area = bytearray(layout.CODE_BYTES[codes.bits])
            floats = np.zeros(2 * layout.PANEL, dtype=np.float32)
            for i in range(min(layout.PANEL, rows - panel * layout.PANEL)):
                row = panel * layout.PANEL + i
                values = codes.codes[row, block * layout.BLOCK : (block + 1) * layout.BLOCK]
                for j, value in enumerate(values.tolist()):
                    group, t = divmod(j, layout.GROUP)
                    if codes.bits == 8:
                        area[(group * layout.PANEL + i) * 4 + t] = value
                    else:  # groups 0-3 in the low nibbles, 4-7 in the high ones
                        area[((group % 4) * layout.PANEL + i) * 4 + t] |= value << (group // 4 * 4)
                floats[i] = codes.scales[row, block]
                floats[layout.PANEL + i] = codes.mins[row, block]
            out += area + floats.tobytes()
    return bytes(out)


@pytest.mark.parametrize("rows", [1, 16, 17, 40])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_pack_writes_the_layout_and_unpack_inverts_it(qtype: Q, rows: int) -> None:
    codes = quantized_weight(qtype, 64, rows)[1]
    weight = quantized.pack(codes)
    assert (weight.bits, weight.rows, weight.k) == (codes.bits, rows, 64)
    assert weight.data.data_ptr() % 64 == 0
    assert weight.data.numel() == layout.packed_bytes(rows, 64, codes.bits)
    assert weight.data.numpy().tobytes() == reference_pack(codes)
    back = quantized.unpack(weight)
    assert back.bits == codes.bits and back.source == codes.source
    for name in ("codes", "scales", "mins"):
        original, restored = getattr(codes, name), getattr(back, name)
        assert restored.dtype == original.dtype and np.array_equal(restored, original), name


def test_pack_refuses_4_bit_codes_above_15() -> None:
    codes = quantized_weight(Q.Q8_0, 64)[1]
    with pytest.raises(ValueError, match="above 15"):
        quantized.pack(BlockCodes(4, codes.codes, codes.scales, codes.mins, "bad"))


# ---- The matmul --------------------------------------------------------------------------------


def quantize_like_the_kernel(
    x: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """The kernel's int8 activations, float32 step by step: q [m, blocks, 32], dx, xsum."""
    blocks = x.reshape(x.shape[0], -1, layout.BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    dx = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(np.clip(blocks * inverse[..., None], -127, 127)).astype(np.int32)
    xsum = q.sum(axis=-1).astype(np.float32) * dx
    return q, dx, xsum


@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("path", quantized.available_paths())
def test_each_path_is_a_float64_matmul_but_for_the_activations_rounding(
    qtype: Q, k: int, path: str
) -> None:
    """Against x @ w^T + b in float64: within what moving each activation by half its block's
    step (dx / 2) can change, plus float32 rounding. And against the kernel's own formula done
    exactly (its integer sums from the activations quantized as it does): float32 rounding only,
    so that a wrong code or activation in any block would show."""
    codes = quantized_weight(qtype, k)[1]
    x = activations(k)
    bias = torch.randn(ROWS, generator=torch.Generator().manual_seed(1))
    got = quantized.quantized_linear(x, packed(qtype, k), bias, path=quantized.PATHS[path])
    assert got.shape == (BATCH, ROWS) and got.dtype == torch.float32
    got64 = got.double().numpy()

    w = codes.dequantize().astype(np.float64)
    xs = x.numpy().astype(np.float64)
    q, dx, xsum = quantize_like_the_kernel(x.numpy())
    blocks = k // layout.BLOCK
    magnitude = np.abs(xs) @ np.abs(w).T + np.abs(bias.double().numpy())
    rounding = (np.repeat(dx, layout.BLOCK, axis=1).astype(np.float64) / 2 * 1.0001) @ np.abs(w).T
    slack = 2 * (2 * blocks + 4) * EPS32 * (magnitude + rounding)
    exact = xs @ w.T + bias.double().numpy()
    assert np.all(np.abs(got64 - exact) <= rounding + slack)

    u = codes.codes.reshape(ROWS, blocks, layout.BLOCK).astype(np.int32)
    isum = np.einsum("ibt,jbt->ijb", q, u).astype(np.float64)
    scaled = codes.scales[None].astype(np.float64) * dx[:, None].astype(np.float64) * isum
    terms = scaled + codes.mins[None].astype(np.float64) * xsum[:, None].astype(np.float64)
    formula = terms.sum(axis=-1) + bias.double().numpy()
    formula_slack = 2 * (2 * blocks + 4) * EPS32 * (np.abs(terms).sum(axis=-1) + np.abs(formula))
    assert np.all(np.abs(got64 - formula) <= formula_slack)


@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_the_same_bits_whatever_the_path_batch_and_threads(
    qtype: Q, k: int, restore_threads: None
) -> None:
    """Every path gives the scalar reference's bits; with the fastest path, the first m rows of
    a batch of m (every m from 1 to 64) are the bits of the batch of 64, and so is a row alone;
    two threads give one thread's bits."""
    weight = packed(qtype, k)
    x = activations(k, seed=2)
    torch.set_num_threads(1)
    reference = quantized.quantized_linear(x, weight, path=quantized.PATHS["scalar"])
    for path in quantized.available_paths():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = quantized.quantized_linear(x, weight, path=quantized.PATHS[path])
            assert torch.equal(got, reference), (path, threads)
    torch.set_num_threads(2)
    for m in range(1, BATCH + 1):
        assert torch.equal(quantized.quantized_linear(x[:m], weight), reference[:m]), m
    for row in (0, 5, 37, 63):
        alone = quantized.quantized_linear(x[row : row + 1], weight)
        assert torch.equal(alone[0], reference[row]), row


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("path", quantized.available_paths())
def test_every_short_tile_of_each_path(qtype: Q, path: str) -> None:
    """Batches of 1-13 rows: every path's full tiles and each of its short last tiles."""
    weight = packed(qtype, 576)
    x = activations(576, seed=3)
    reference = quantized.quantized_linear(x[:13], weight, path=quantized.PATHS["scalar"])
    for m in range(1, 14):
        got = quantized.quantized_linear(x[:m], weight, path=quantized.PATHS[path])
        assert torch.equal(got, reference[:m]), m


def test_a_batch_of_several_work_items_of_rows(restore_threads: None) -> None:
    """200 rows: past the 192 rows of one work item, on two threads, every path."""
    weight = packed(Q.Q4_1, 576)
    x = activations(576, rows=200, seed=4)
    torch.set_num_threads(2)
    reference = quantized.quantized_linear(x, weight, path=quantized.PATHS["scalar"])
    for path in quantized.available_paths():
        assert torch.equal(
            quantized.quantized_linear(x, weight, path=quantized.PATHS[path]), reference
        )
    assert torch.equal(quantized.quantized_linear(x[199:], weight)[0], reference[199])


def test_a_row_with_a_nan_gives_nans_and_leaves_the_others_alone() -> None:
    weight = packed(Q.Q4_1, 576)
    x = activations(576).clone()
    clean = quantized.quantized_linear(x, weight)
    x[3, 100] = float("nan")
    x[9, 0] = float("inf")
    dirty = quantized.quantized_linear(x, weight)
    assert torch.isnan(dirty[[3, 9]]).all()
    others = [r for r in range(BATCH) if r not in (3, 9)]
    assert torch.equal(dirty[others], clean[others])


def test_inputs_it_does_not_take() -> None:
    weight = packed(Q.Q8_0, 576)
    x = activations(576)
    for bad in (
        x.double(),
        torch.randn(4, 575),
        torch.randn(576, 4).t(),  # a row's elements not adjacent
        torch.randn(576),
    ):
        with pytest.raises(ValueError, match="quantized_linear takes float32"):
            quantized.quantized_linear(bad, weight)
    for bias in (torch.randn(ROWS).double(), torch.randn(ROWS + 1), torch.randn(2 * ROWS)[::2]):
        with pytest.raises(ValueError, match="bias"):
            quantized.quantized_linear(x, weight, bias)
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        quantized.quantized_linear(x, weight, path=7)
    assert quantized.quantized_linear(x[:0], weight).shape == (0, ROWS)


# ---- The embedding lookup ----------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_embedding_rows_are_the_dequantized_rows(qtype: Q) -> None:
    codes = quantized_weight(qtype, 576)[1]
    ids = torch.tensor([[0, 39, 17], [17, 16, 15]])
    got = quantized.embedding_rows(packed(qtype, 576), ids)
    assert got.shape == (2, 3, 576) and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), codes.dequantize()[ids.numpy()])
    with pytest.raises(IndexError):
        quantized.embedding_rows(packed(qtype, 576), torch.tensor([3, ROWS]))
