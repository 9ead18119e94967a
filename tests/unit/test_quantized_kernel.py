"""The CPU kernel for quantized weights (engine/kernels/cpu/quantized_linear.cpp, quantized.py)
against references this project did not write: every GGUF block type it serves, as random valid
blocks, whose values the gguf package's dequantizer computes, and a float64 matmul. The load-time
formats (U4, U8: BlockCodes of the q4_1 and q8_0 schemes) against their own definition,
scale * code + minimum.

Every path this CPU runs (scalar, AVX2, AVX512-VNNI) must stay within the error that rounding the
activations to int8 can cause, give the bits the scalar reference gives, and give a row the same
bits whatever the rows beside it and the thread count."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import gguf
import numpy as np
import numpy.typing as npt
import pytest
import torch

from engine.gguf.native_blocks import NATIVE_TYPES
from engine.kernels.cpu import quantized
from engine.quantization import layout
from engine.quantization.quantize import quantize
from tests.unit.test_gguf_quants import random_rows  # valid random blocks, finite scales

Floats = npt.NDArray[np.float32]
FORMATS = [*NATIVE_TYPES, "U4", "U8"]
SCHEMES = {"U4": "q4_1", "U8": "q8_0"}  # the load-time scheme whose codes each format holds
WHOLE_CHUNKS = [name for name, f in layout.FORMATS.items() if f.whole_chunks]
# SmolLM2-135M's hidden width (18 blocks: two chunks and a short one), an MLP's and a 7B model's;
# rows of the K-quants and IQ4_XS are whole super-blocks of 256.
WIDTHS = {False: [576, 1536, 4096], True: [256, 1536, 4096]}
ROWS = 40  # two full panels and a partial one
BATCH = 64
EPS32 = 2.0**-24  # float32's unit roundoff


def widths(format_name: str) -> list[int]:
    return WIDTHS[format_name in WHOLE_CHUNKS]


@functools.cache
def weight(format_name: str, k: int, rows: int = ROWS) -> tuple[quantized.PackedWeight, Floats]:
    """A random [rows, k] weight packed in the format, and its values as the reference gives
    them (gguf.quants.dequantize; BlockCodes.dequantize for the load-time formats)."""
    rng = np.random.default_rng(k * 100 + rows + sum(map(ord, format_name)))
    if format_name in SCHEMES:
        floats = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
        floats[:, :32] += 0.02  # a block whose values are all one side of 0
        codes = quantize(floats, SCHEMES[format_name])
        return quantized.pack(codes), codes.dequantize()
    raw = random_rows(format_name, rows, k, rng)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[format_name])
    part = quantized.pack_gguf(raw, format_name, (rows, k))
    return quantized.PackedWeight((part,)), np.asarray(values, np.float32)


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


# ---- The packed weight -------------------------------------------------------------------------


@pytest.mark.parametrize("format_name", FORMATS)
def test_packed_bytes_are_the_kernels_count_and_near_the_files(format_name: str) -> None:
    fmt = layout.FORMATS[format_name]
    for rows in (1, 16, 40):
        for k in widths(format_name):
            size = layout.packed_bytes(rows, k, format_name)
            assert size == quantized.kernel_bytes(format_name, rows, k), (rows, k)
    if format_name in NATIVE_TYPES:  # a whole panel of 4096 values: within 3 % of the file's
        gguf_type = gguf.GGMLQuantizationType[format_name]
        block, type_size = gguf.GGML_QUANT_SIZES[gguf_type]
        file_bytes = layout.PANEL * 4096 // block * type_size
        assert file_bytes <= fmt.packed_bytes(layout.PANEL, 4096) <= 1.03 * file_bytes


def test_rows_of_k_quants_are_whole_super_blocks() -> None:
    for format_name in WHOLE_CHUNKS:
        with pytest.raises(ValueError, match="multiple of 256"):
            layout.packed_bytes(16, 288, format_name)
        assert quantized.kernel_bytes(format_name, 16, 288) == -1


def reference_chunk(fields: object, panel: int, first: int, count: int) -> bytes:
    """One chunk of the layout as layout.py words it, one byte at a time."""
    from engine.quantization.packing import Fields

    assert isinstance(fields, Fields)
    fmt = fields.format
    rows = fields.codes.shape[0]
    present = range(min(layout.PANEL, rows - panel * layout.PANEL))

    def row(i: int) -> int:
        return panel * layout.PANEL + i

    out = bytearray()
    if fmt.header_fields:
        header = bytearray(layout.ALIGN)
        at = 0
        for f, width in enumerate(fmt.header_fields):
            start = sum(fmt.header_fields[:f])
            for i in present:
                values = fields.header[row(i), first // 8, start : start + width]  # type: ignore[index]
                header[at + i * width : at + (i + 1) * width] = values.tobytes()
            at += layout.PANEL * width
        out += header
    for b in range(first, first + count):
        area = bytearray(fmt.code_bytes)
        for i in present:
            for j, code in enumerate(fields.codes[row(i), 32 * b : 32 * b + 32].tolist()):
                group, t = divmod(j, layout.GROUP)
                if fmt.code_bits == 8:
                    area[(group * layout.PANEL + i) * 4 + t] = code
                else:  # groups 0-3 in the low nibbles, 4-7 in the high ones
                    area[((group % 4) * layout.PANEL + i) * 4 + t] |= (code & 15) << (
                        group // 4 * 4
                    )
        out += area
    for b in range(first, first + count):
        planes = bytearray(fmt.high_bytes)
        for i in present:
            for j, code in enumerate(fields.codes[row(i), 32 * b : 32 * b + 32].tolist()):
                group, t = divmod(j, layout.GROUP)
                if fmt.code_bits == 5:
                    planes[i * 4 + t] |= (code >> 4) << group
                elif fmt.code_bits == 6:
                    planes[64 * (group // 4) + i * 4 + t] |= (code >> 4) << (2 * (group % 4))
        out += planes
    for b in range(first, first + count):
        for f, width in enumerate(fmt.scale_fields):
            start = sum(fmt.scale_fields[:f])
            area = bytearray(layout.PANEL * width)
            for i in present:
                area[i * width : (i + 1) * width] = fields.scales[
                    row(i), b, start : start + width
                ].tobytes()
            out += area
    return bytes(out) + bytes(-len(out) % layout.ALIGN)


@pytest.mark.parametrize(
    ("format_name", "k"),
    [("Q4_1", 320), ("Q5_K", 512), ("Q6_K", 256), ("IQ4_XS", 256), ("Q8_0", 64)],
)
def test_pack_writes_the_layout(format_name: str, k: int) -> None:
    from engine.gguf.native_blocks import fields

    rows = 20
    raw = random_rows(format_name, rows, k, np.random.default_rng(5))
    unpacked = fields(raw, format_name, (rows, k))
    packed = quantized.pack_gguf(raw, format_name, (rows, k))
    assert packed.data.data_ptr() % 64 == 0
    expected = b"".join(
        reference_chunk(unpacked, panel, first, min(8, k // 32 - first))
        for panel in range(layout.panels(rows))
        for first in range(0, k // 32, 8)
    )
    assert packed.data.numpy().tobytes() == expected


@pytest.mark.parametrize("format_name", FORMATS)
def test_embedding_rows_are_the_references_values(format_name: str) -> None:
    packed, values = weight(format_name, widths(format_name)[0])
    ids = torch.tensor([[0, 39, 17], [17, 16, 15]])
    got = quantized.embedding_rows(packed, ids)
    assert got.shape == (2, 3, packed.k) and got.dtype == torch.float32
    expected = values[ids.numpy()]
    assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))  # signed zeros
    with pytest.raises(IndexError):
        quantized.embedding_rows(packed, torch.tensor([3, ROWS]))


# ---- The matmul --------------------------------------------------------------------------------


def quantize_like_the_kernel(
    x: Floats,
) -> tuple[npt.NDArray[np.int32], Floats]:
    """The kernel's int8 activations, float32 step by step: q [m, blocks, 32] and dx."""
    blocks = x.reshape(x.shape[0], -1, layout.BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    dx = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(np.clip(blocks * inverse[..., None], -127, 127)).astype(np.int32)
    return q, dx


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("path", quantized.available_paths())
def test_each_path_is_a_float64_matmul_but_for_the_activations_rounding(
    format_name: str, path: str
) -> None:
    """Against x @ w^T + b in float64: within what moving each activation by half its block's
    step (dx / 2) can change, plus float32 rounding. And against the same sum over the
    activations as the kernel quantizes them (dx * q): float32 rounding only (of the weight's
    values and of the kernel's sums), so that a wrong code or activation in a block would show."""
    for k in widths(format_name):
        packed, w32 = weight(format_name, k)
        x = activations(k)
        bias = torch.randn(ROWS, generator=torch.Generator().manual_seed(1))
        got = quantized.quantized_linear(x, packed, bias, path=quantized.PATHS[path])
        assert got.shape == (BATCH, ROWS) and got.dtype == torch.float32
        got64 = got.double().numpy()

        w = w32.astype(np.float64)
        xs, b64 = x.numpy().astype(np.float64), bias.double().numpy()
        q, dx = quantize_like_the_kernel(x.numpy())
        steps = np.repeat(dx, layout.BLOCK, axis=1).astype(np.float64)
        blocks = k // layout.BLOCK
        sums = 3 * blocks + 4  # float operations in a row's chain
        magnitude = np.abs(xs) @ np.abs(w).T + np.abs(b64)
        rounding = (steps / 2 * 1.0001) @ np.abs(w).T
        slack = 2 * sums * EPS32 * (magnitude + rounding)
        exact = xs @ w.T + b64
        assert np.all(np.abs(got64 - exact) <= rounding + slack), k

        xq = q.reshape(BATCH, k) * steps
        formula = xq @ w.T + b64
        # Each value's parts (d * code, a minimum) are within a few times its block's largest.
        block_top = np.repeat(np.abs(w).reshape(ROWS, blocks, -1).max(axis=-1), layout.BLOCK, 1)
        weight_rounding = 8 * EPS32 * (np.abs(xq) @ block_top.T)
        terms = np.abs(xq) @ np.abs(w).T + np.abs(b64)
        assert np.all(np.abs(got64 - formula) <= 2 * sums * EPS32 * terms + weight_rounding), k


@pytest.mark.parametrize("format_name", FORMATS)
def test_the_same_bits_whatever_the_path_batch_and_threads(
    format_name: str, restore_threads: None
) -> None:
    """Every path gives the scalar reference's bits; with the fastest path, the first m rows of
    a batch of m (every m from 1 to 64) are the bits of the batch of 64, and so is a row alone;
    two threads give one thread's bits."""
    k = widths(format_name)[1]
    packed = weight(format_name, k)[0]
    x = activations(k, seed=2)
    torch.set_num_threads(1)
    reference = quantized.quantized_linear(x, packed, path=quantized.PATHS["scalar"])
    for path in quantized.available_paths():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = quantized.quantized_linear(x, packed, path=quantized.PATHS[path])
            assert torch.equal(got, reference), (path, threads)
            for m in range(1, 18):  # every full and short tile of each path
                short = quantized.quantized_linear(x[:m], packed, path=quantized.PATHS[path])
                assert torch.equal(short, reference[:m]), (path, m)
    torch.set_num_threads(2)
    for m in range(18, BATCH + 1):
        assert torch.equal(quantized.quantized_linear(x[:m], packed), reference[:m]), m
    for row in (0, 5, 37, 63):
        alone = quantized.quantized_linear(x[row : row + 1], packed)
        assert torch.equal(alone[0], reference[row]), row


def test_parts_of_different_formats_are_their_separate_matmuls(restore_threads: None) -> None:
    """A fused q|k|v of Q4_K, Q4_K and Q6_K parts (the middle one 24 rows: not whole panels),
    with a bias: its columns are each part's own matmul, for every path and thread count."""
    k = 512
    rng = np.random.default_rng(12)
    shapes = [("Q4_K", 48), ("Q4_K", 24), ("Q6_K", 40)]
    parts = [
        quantized.pack_gguf(random_rows(name, rows, k, rng), name, (rows, k))
        for name, rows in shapes
    ]
    fused = quantized.stacked(parts)
    assert (fused.rows, fused.k, fused.source) == (112, k, "Q4_K+Q6_K")
    assert fused.nbytes == sum(layout.packed_bytes(rows, k, name) for name, rows in shapes)
    x = activations(k, rows=13, seed=6)
    bias = torch.randn(112, generator=torch.Generator().manual_seed(3))
    separate = (
        torch.cat(
            [quantized.quantized_linear(x, quantized.stacked([part])) for part in parts], dim=1
        )
        + bias
    )
    for path in quantized.available_paths():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = quantized.quantized_linear(x, fused, bias, path=quantized.PATHS[path])
            assert torch.equal(got, separate), (path, threads)


def test_a_batch_of_several_work_items_of_rows(restore_threads: None) -> None:
    """200 rows: past the 192 rows of one work item, on two threads, every path."""
    packed = weight("Q4_K", 1536)[0]
    x = activations(1536, rows=200, seed=4)
    torch.set_num_threads(2)
    reference = quantized.quantized_linear(x, packed, path=quantized.PATHS["scalar"])
    for path in quantized.available_paths():
        got = quantized.quantized_linear(x, packed, path=quantized.PATHS[path])
        assert torch.equal(got, reference), path
    assert torch.equal(quantized.quantized_linear(x[199:], packed)[0], reference[199])


def test_a_row_with_a_nan_gives_nans_and_leaves_the_others_alone() -> None:
    packed = weight("Q5_K", 1536)[0]
    x = activations(1536).clone()
    clean = quantized.quantized_linear(x, packed)
    x[3, 100] = float("nan")
    x[9, 0] = float("inf")
    dirty = quantized.quantized_linear(x, packed)
    assert torch.isnan(dirty[[3, 9]]).all()
    others = [r for r in range(BATCH) if r not in (3, 9)]
    assert torch.equal(dirty[others], clean[others])


def test_inputs_it_does_not_take() -> None:
    packed = weight("Q8_0", 576)[0]
    x = activations(576)
    for bad in (
        x.double(),
        torch.randn(4, 575),
        torch.randn(576, 4).t(),  # a row's elements not adjacent
        torch.randn(576),
    ):
        with pytest.raises(ValueError, match="quantized_linear takes float32"):
            quantized.quantized_linear(bad, packed)
    for bias in (torch.randn(ROWS).double(), torch.randn(ROWS + 1), torch.randn(2 * ROWS)[::2]):
        with pytest.raises(ValueError, match="bias"):
            quantized.quantized_linear(x, packed, bias)
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        quantized.quantized_linear(x, packed, path=7)
    assert quantized.quantized_linear(x[:0], packed).shape == (0, ROWS)
    with pytest.raises(ValueError, match="one row length"):
        quantized.stacked([packed.parts[0], weight("Q8_0", 1536)[0].parts[0]])
