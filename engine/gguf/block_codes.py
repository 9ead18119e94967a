"""GGUF block types onto BlockCodes, the one quantized form the CPU kernels pack.

Every type with one scale (and one offset) per 32 values maps exactly: the codes are the file's
integers made unsigned, and BlockCodes.dequantize() (scale * code + min in float32) gives the
values engine.gguf.quants.dequantize gives, bit for bit, but for the sign of a zero:

- Q4_0: code = the nibble, scale = d, min = -8 d.  Q5_0: code = the 5-bit value, min = -16 d.
- Q8_0: code = q + 128, scale = d, min = -128 d.
  These three are exact because d is a float16: a code times d needs at most 19 bits, so
  neither the product nor the sum rounds. A value of 0 comes out +0.0 where the reference's
  d * 0 is -0.0 for a negative d.
- Q4_1, Q5_1: scale = d, min = m, the reference's own operations.
- Q4_K, Q5_K, per sub-block of 32: scale = d * sc and min = -(dmin * mn), the float32
  products engine.gguf.quants forms, so that code * scale + min rounds like its
  `values *= d; values -= dm`.

Q6_K scales every 16 values, two scales to a block of 32, so it cannot map exactly onto one
scale per 32 in general. Its values are re-quantized per block of 32 to 8-bit asymmetric codes
(scale = (max - min) / 255, min = the block's minimum): each value is within scale / 2 of the
Q6_K one (up to float32 rounding). Both halves scaled alike, 64 Q6_K steps span at most 255 new
ones (64 of the larger step when they differ), so the error is at most about 1/8 of Q6_K's own
step.

Q4_0, Q4_1 and Q4_K give 4-bit codes; the rest 8-bit. Q2_K and Q3_K (scales per 16 values as
well) are not taken, nor the float types: those tensors stay float (`stays_float`). Tensors are
converted a chunk of blocks at a time, so that the temporaries stay a few MiB.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from engine.gguf.quants import (
    CHUNK_VALUES,
    _bit_planes,
    _decode_q6_k,
    _f16,
    _five_bit,
    _k4_scale_min,
    _nibbles,
    _nibbles_into,
    layout,
    row_nbytes,
)
from engine.quantization.codes import BlockCodes
from engine.quantization.layout import BLOCK
from engine.quantization.quantize import quantize_asymmetric

Bytes = npt.NDArray[np.uint8]
Floats = npt.NDArray[np.float32]
# (blocks, type_size) bytes -> writes codes (blocks, block_size), scales and minimums
# (blocks, block_size // 32)
Converter = Callable[[Bytes, Bytes, Floats, Floats], None]


@dataclasses.dataclass(frozen=True)
class Conversion:
    bits: int  # 4 or 8: the width of the codes
    convert: Converter
    exact: bool = True  # False: re-quantized (Q6_K), said so in the codes' source


def _q4_0(blocks: Bytes, codes: Bytes, scales: Floats, mins: Floats) -> None:
    _nibbles_into(blocks[:, 2:], codes.reshape(-1, 2, 16))
    scales[...] = _f16(blocks, 0)
    np.multiply(scales, np.float32(-8), out=mins)


def _q4_1(blocks: Bytes, codes: Bytes, scales: Floats, mins: Floats) -> None:
    _nibbles_into(blocks[:, 4:], codes.reshape(-1, 2, 16))
    scales[...] = _f16(blocks, 0)
    mins[...] = _f16(blocks, 2)


def _q5_0(blocks: Bytes, codes: Bytes, scales: Floats, mins: Floats) -> None:
    codes[...] = _five_bit(blocks[:, 2:6], blocks[:, 6:])
    scales[...] = _f16(blocks, 0)
    np.multiply(scales, np.float32(-16), out=mins)


def _q5_1(blocks: Bytes, codes: Bytes, scales: Floats, mins: Floats) -> None:
    codes[...] = _five_bit(blocks[:, 4:8], blocks[:, 8:])
    scales[...] = _f16(blocks, 0)
    mins[...] = _f16(blocks, 2)


def _q8_0(blocks: Bytes, codes: Bytes, scales: Floats, mins: Floats) -> None:
    # An int8 plus 128, as a uint8, is the same byte with its top bit flipped.
    np.bitwise_xor(blocks[:, 2:], np.uint8(0x80), out=codes)
    scales[...] = _f16(blocks, 0)
    np.multiply(scales, np.float32(-128), out=mins)


def _k4_scales(blocks: Bytes, scales: Floats, mins: Floats) -> None:
    """Q4_K's and Q5_K's eight sub-block scales and minimums, as engine.gguf.quants forms them."""
    d, dm = _k4_scale_min(blocks)
    scales[...] = d[:, :, 0]
    np.negative(dm[:, :, 0], out=mins)


def _q4_k(blocks: Bytes, codes: Bytes, scales: Floats, mins: Floats) -> None:
    n = blocks.shape[0]
    _nibbles_into(blocks[:, 16:].reshape(n * 4, 32), codes.reshape(n * 4, 2, 32))
    _k4_scales(blocks, scales, mins)


def _q5_k(blocks: Bytes, codes: Bytes, scales: Floats, mins: Floats) -> None:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:].reshape(n * 4, 32)).reshape(n, 8, 32)
    high = _bit_planes(blocks[:, 16:48], 1)
    np.bitwise_or(low, high << np.uint8(4), out=codes.reshape(n, 8, 32))
    _k4_scales(blocks, scales, mins)


def _q6_k(blocks: Bytes, codes: Bytes, scales: Floats, mins: Floats) -> None:
    n = blocks.shape[0]
    values = np.empty((n * 8, BLOCK), np.float32)
    _decode_q6_k(blocks, values.reshape(n, -1))
    quantize_asymmetric(
        values, 255, codes.reshape(n * 8, BLOCK), scales.reshape(n * 8, 1), mins.reshape(n * 8, 1)
    )


CONVERSIONS: dict[str, Conversion] = {
    "Q4_0": Conversion(4, _q4_0),
    "Q4_1": Conversion(4, _q4_1),
    "Q4_K": Conversion(4, _q4_k),
    "Q5_0": Conversion(8, _q5_0),
    "Q5_1": Conversion(8, _q5_1),
    "Q5_K": Conversion(8, _q5_k),
    "Q8_0": Conversion(8, _q8_0),
    "Q6_K": Conversion(8, _q6_k, exact=False),
}
QUANTIZED_TYPES: tuple[str, ...] = tuple(CONVERSIONS)
EXACT_TYPES: tuple[str, ...] = tuple(name for name, c in CONVERSIONS.items() if c.exact)


def stays_float(type_name: str) -> bool:
    """Whether a tensor of this type is loaded as float rather than kept quantized."""
    return type_name not in CONVERSIONS


def block_codes(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> BlockCodes:
    """The codes of a tensor of `shape` (rows, k), from the bytes of its whole rows."""
    conversion = CONVERSIONS.get(type_name)
    if conversion is None:
        raise ValueError(
            f"tensor type {type_name!r} does not stay quantized; those that do: {QUANTIZED_TYPES}"
        )
    rows, k = shape
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    expected = rows * row_nbytes(type_name, k)  # raises if a row splits a block
    if data.size != expected:
        raise ValueError(
            f"{type_name} tensor of shape {shape} needs {expected} bytes, got {data.size}"
        )
    blocks_of = layout(type_name)
    blocks = data.reshape(-1, blocks_of.type_size)
    codes = np.empty((rows, k), np.uint8)
    scales = np.empty((rows, k // BLOCK), np.float32)
    mins = np.empty((rows, k // BLOCK), np.float32)
    # Views with one row per file block: each chunk writes its slice of the outputs in place.
    per_block = blocks_of.block_size // BLOCK
    code_blocks = codes.reshape(-1, blocks_of.block_size)
    scale_blocks, min_blocks = scales.reshape(-1, per_block), mins.reshape(-1, per_block)
    step = max(1, CHUNK_VALUES // blocks_of.block_size)
    for start in range(0, blocks.shape[0], step):
        part = slice(start, start + step)
        conversion.convert(blocks[part], code_blocks[part], scale_blocks[part], min_blocks[part])
    source = (
        type_name if conversion.exact else f"{type_name} (re-quantized to {conversion.bits} bits)"
    )
    return BlockCodes(conversion.bits, codes, scales, mins, source=source)
