"""Vectorized dequantization of ggml's tensor types to float32.

Each decoder turns a (blocks, type_size) uint8 array into (blocks, block_size) float32 values,
over every block at once. The integer codes are exact in float32 however they are formed; the
scales, products and sums are float32 operations in the same order as `gguf.quants`, so the
results are bit-equal to that reference. Tensors are decoded a chunk of blocks at a time, so
that the temporaries stay a few MiB whatever the tensor's size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from math import prod

import numpy as np
import numpy.typing as npt

Bytes = npt.NDArray[np.uint8]
Floats = npt.NDArray[np.float32]
Decoder = Callable[[Bytes, Floats], None]

QK_K = 256  # values per super-block of the K-quants
CHUNK_VALUES = 1 << 19  # values decoded per chunk (2 MiB of output)


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    block_size: int  # values per block
    type_size: int  # bytes per block
    decode: Decoder  # (blocks, type_size) uint8 -> writes (blocks, block_size) float32


def _f16(blocks: Bytes, at: int) -> Floats:
    """The float16 field at byte `at` of every block, as a (blocks, 1) float32 column."""
    return blocks[:, at : at + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: Bytes) -> Bytes:
    """(n, k) bytes -> (n, 2, k): the low nibbles of all k bytes, then the high nibbles."""
    out = np.empty((packed.shape[0], 2, packed.shape[1]), np.uint8)
    _nibbles_into(packed, out)
    return out


def _nibbles_into(packed: Bytes, out: np.ndarray) -> None:
    """`_nibbles` written into `out`, cast to its dtype: float32 spares a uint8 temporary."""
    np.bitwise_and(packed, np.uint8(0x0F), out=out[:, 0], casting="unsafe")
    np.right_shift(packed, np.uint8(4), out=out[:, 1], casting="unsafe")


def _bit_planes(packed: Bytes, bits: int) -> Bytes:
    """(n, k) bytes -> (n, 8 // bits, k): field j of every byte is (byte >> bits * j) & mask."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(1, -1, 1)
    return (packed[:, None, :] >> shifts) & np.uint8((1 << bits) - 1)


def _low_bits(packed: Bytes) -> Bytes:
    """(n, 4) bytes read as a little-endian uint32 -> (n, 32): bit i of it at column i."""
    return np.unpackbits(packed, axis=-1, bitorder="little")


def _scale_min_k4(packed: Bytes) -> tuple[Bytes, Bytes]:
    """The eight 6-bit scales and eight 6-bit minimums packed in 12 bytes (Q4_K, Q5_K)."""
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def _decode_f32(blocks: Bytes, out: Floats) -> None:
    out[...] = blocks.view("<f4")


def _decode_f16(blocks: Bytes, out: Floats) -> None:
    out[...] = blocks.view("<f2")


def _decode_bf16(blocks: Bytes, out: Floats) -> None:
    # bfloat16 is the top half of a float32: widen the bits, NaN payloads included.
    widened = blocks.view("<u2").astype(np.uint32) << np.uint32(16)
    out[...] = widened.view(np.float32)


def _decode_q4_0(blocks: Bytes, out: Floats) -> None:
    _nibbles_into(blocks[:, 2:], out.reshape(-1, 2, 16))
    out -= np.float32(8)
    out *= _f16(blocks, 0)


def _decode_q4_1(blocks: Bytes, out: Floats) -> None:
    _nibbles_into(blocks[:, 4:], out.reshape(-1, 2, 16))
    out *= _f16(blocks, 0)
    out += _f16(blocks, 2)


def _five_bit(high: Bytes, low: Bytes) -> Bytes:
    """Q5_0/Q5_1 values: 32 low nibbles plus bit i of a little-endian uint32 as bit 4."""
    return _nibbles(low).reshape(-1, 32) | (_low_bits(high) << np.uint8(4))


def _decode_q5_0(blocks: Bytes, out: Floats) -> None:
    out[...] = _five_bit(blocks[:, 2:6], blocks[:, 6:])
    out -= np.float32(16)
    out *= _f16(blocks, 0)


def _decode_q5_1(blocks: Bytes, out: Floats) -> None:
    out[...] = _five_bit(blocks[:, 4:8], blocks[:, 8:])
    out *= _f16(blocks, 0)
    out += _f16(blocks, 2)


def _decode_q8_0(blocks: Bytes, out: Floats) -> None:
    np.multiply(blocks[:, 2:].view(np.int8), _f16(blocks, 0), out=out, dtype=np.float32)


def _decode_q2_k(blocks: Bytes, out: Floats) -> None:
    n = blocks.shape[0]
    scales = blocks[:, :16]
    values = out.reshape(n, 16, 16)
    values[...] = _bit_planes(blocks[:, 16:80].reshape(n * 2, 32), 2).reshape(n, 16, 16)
    values *= (_f16(blocks, 80) * (scales & 0x0F).astype(np.float32))[:, :, None]
    values -= (_f16(blocks, 82) * (scales >> 4).astype(np.float32))[:, :, None]


def _q3_k_scales(packed: Bytes) -> Floats:
    """Q3_K's sixteen 6-bit signed scales: low nibbles in bytes 0-7, high pairs in 8-11."""
    low = _nibbles(packed[:, :8]).reshape(-1, 16)
    high = _bit_planes(packed[:, 8:12], 2).reshape(-1, 16)
    return ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)


def _decode_q3_k(blocks: Bytes, out: Floats) -> None:
    n = blocks.shape[0]
    low = _bit_planes(blocks[:, 32:96].reshape(n * 2, 32), 2).reshape(n, 16, 16)
    high = _bit_planes(blocks[:, :32], 1).reshape(n, 16, 16)
    values = out.reshape(n, 16, 16)
    # A clear high bit subtracts 4; a set one adds nothing.
    values[...] = low.astype(np.int8) - ((high ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    values *= (_f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108]))[:, :, None]


def _k4_scale_min(blocks: Bytes) -> tuple[Floats, Floats]:
    """Per-32-value scale and minimum of Q4_K and Q5_K, each (blocks, 8, 1)."""
    scales, mins = _scale_min_k4(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scales.astype(np.float32))[:, :, None]
    dm = (_f16(blocks, 2) * mins.astype(np.float32))[:, :, None]
    return d, dm


def _decode_q4_k(blocks: Bytes, out: Floats) -> None:
    n = blocks.shape[0]
    _nibbles_into(blocks[:, 16:].reshape(n * 4, 32), out.reshape(n * 4, 2, 32))
    d, dm = _k4_scale_min(blocks)
    values = out.reshape(n, 8, 32)
    values *= d
    values -= dm


def _decode_q5_k(blocks: Bytes, out: Floats) -> None:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:].reshape(n * 4, 32)).reshape(n, 8, 32)
    high = _bit_planes(blocks[:, 16:48], 1)
    d, dm = _k4_scale_min(blocks)
    values = out.reshape(n, 8, 32)
    values[...] = low | (high << np.uint8(4))
    values *= d
    values -= dm


def _decode_q6_k(blocks: Bytes, out: Floats) -> None:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128].reshape(n * 2, 64)).reshape(n, 8, 32)
    high = _bit_planes(blocks[:, 128:192].reshape(n * 2, 32), 2).reshape(n, 8, 32)
    values = out.reshape(n, 16, 16)
    values[...] = (low | (high << np.uint8(4))).reshape(n, 16, 16)
    values -= np.float32(32)
    values *= (_f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]


# IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl).
IQ4_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)


def _decode_iq4_nl(blocks: Bytes, out: Floats) -> None:
    indices = _nibbles(blocks[:, 2:]).reshape(-1, 32)
    np.multiply(_f16(blocks, 0), IQ4_LEVELS[indices], out=out)


def iq4_xs_scales(blocks: Bytes) -> npt.NDArray[np.int8]:
    """IQ4_XS's eight 6-bit scales less 32: low nibbles in bytes 4-7, high pairs in 2-3."""
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 4:8]).transpose(0, 2, 1).reshape(n, 8)  # block i: byte i/2's
    high = _bit_planes(blocks[:, 2:4], 2).transpose(0, 2, 1).reshape(n, 8)  # bits 2i, 2i+1
    return ((low | (high << np.uint8(4))).astype(np.int16) - 32).astype(np.int8)


def _decode_iq4_xs(blocks: Bytes, out: Floats) -> None:
    n = blocks.shape[0]
    indices = _nibbles(blocks[:, 8:].reshape(n * 8, 16)).reshape(n, 8, 32)
    scales = (_f16(blocks, 0) * iq4_xs_scales(blocks).astype(np.float32))[:, :, None]
    np.multiply(scales, IQ4_LEVELS[indices], out=out.reshape(n, 8, 32))


LAYOUTS: dict[str, BlockLayout] = {
    "F32": BlockLayout(1, 4, _decode_f32),
    "F16": BlockLayout(1, 2, _decode_f16),
    "BF16": BlockLayout(1, 2, _decode_bf16),
    "Q4_0": BlockLayout(32, 18, _decode_q4_0),
    "Q4_1": BlockLayout(32, 20, _decode_q4_1),
    "Q5_0": BlockLayout(32, 22, _decode_q5_0),
    "Q5_1": BlockLayout(32, 24, _decode_q5_1),
    "Q8_0": BlockLayout(32, 34, _decode_q8_0),
    "Q2_K": BlockLayout(QK_K, 84, _decode_q2_k),
    "Q3_K": BlockLayout(QK_K, 110, _decode_q3_k),
    "Q4_K": BlockLayout(QK_K, 144, _decode_q4_k),
    "Q5_K": BlockLayout(QK_K, 176, _decode_q5_k),
    "Q6_K": BlockLayout(QK_K, 210, _decode_q6_k),
    "IQ4_NL": BlockLayout(32, 18, _decode_iq4_nl),
    "IQ4_XS": BlockLayout(QK_K, 136, _decode_iq4_xs),
}
SUPPORTED_TYPES: tuple[str, ...] = tuple(LAYOUTS)


def layout(type_name: str) -> BlockLayout:
    found = LAYOUTS.get(type_name)
    if found is None:
        raise ValueError(
            f"tensor type {type_name!r} is not supported; supported: {SUPPORTED_TYPES}"
        )
    return found


def row_nbytes(type_name: str, row_len: int) -> int:
    """Bytes of `row_len` consecutive values of a type; `row_len` must fill whole blocks."""
    blocks = layout(type_name)
    if row_len % blocks.block_size:
        raise ValueError(
            f"a row of {row_len} values is not a multiple of {type_name}'s block size "
            f"({blocks.block_size})"
        )
    return row_len // blocks.block_size * blocks.type_size


def dequantize(
    raw: np.ndarray, type_name: str, shape: tuple[int, ...], out: Floats | None = None
) -> Floats:
    """Decode the bytes of a tensor of `shape` (numpy order, last axis innermost) to float32.

    `out`, when given, is a C-contiguous float32 array of `shape` to decode into (e.g. a torch
    tensor's storage, sparing a copy); it is returned.
    """
    blocks_of = layout(type_name)
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    row_len = shape[-1] if shape else 1
    expected = prod(shape[:-1]) * row_nbytes(type_name, row_len)  # raises if a row splits a block
    if data.size != expected:
        raise ValueError(
            f"{type_name} tensor of shape {shape} needs {expected} bytes, got {data.size}"
        )
    blocks = data.reshape(-1, blocks_of.type_size)
    result = _output(out, shape)
    values = result.reshape(blocks.shape[0], blocks_of.block_size)  # a view: result is contiguous
    step = max(1, CHUNK_VALUES // blocks_of.block_size)
    for start in range(0, blocks.shape[0], step):
        blocks_of.decode(blocks[start : start + step], values[start : start + step])
    return result


def _output(out: Floats | None, shape: tuple[int, ...]) -> Floats:
    if out is None:
        return np.empty(shape, np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(
            f"out must be a C-contiguous float32 array of shape {shape}, "
            f"got {out.dtype} {out.shape} (contiguous: {out.flags.c_contiguous})"
        )
    return out
