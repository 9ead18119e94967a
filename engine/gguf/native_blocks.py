"""A GGUF file's quantized tensors in the CPU kernel's packed formats, each block type at its own
width (engine/quantization/layout.py): the file's codes and scales are rearranged, never
re-quantized nor widened, so the kernel reads the values gguf.quants.dequantize gives.

Each type's fields, from its blocks (ggml's block structs):

- Q4_0, IQ4_NL: d, 16 bytes of nibbles (value j low, j + 16 high); IQ4's code is the level's
  index. Q4_1: d, m, nibbles. Q5_0 (Q5_1): d (m), 32 fifth bits, nibbles. Q8_0: d, 32 int8
  (code q + 128).
- Q4_K, Q5_K: d, dmin (the chunk's header), twelve bytes of 6-bit scales and minimums (one byte
  each per block of 32), Q5_K's fifth bits, nibbles.
- Q6_K: 4 low bits, 2 high bits, 16 int8 scales (two per block of 32), d (the header).
- IQ4_XS: d (the header), 6-bit scales in 2 + 4 bytes (one int8 ls - 32 per block), nibbles.

Tensors are packed a slab of rows at a time, so that the temporaries stay a few MiB.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from engine.gguf.quants import (
    _bit_planes,
    _five_bit,
    _nibbles,
    _nibbles_into,
    _scale_min_k4,
    iq4_xs_scales,
    layout,
    row_nbytes,
)
from engine.quantization.layout import BLOCK, FORMATS, PANEL
from engine.quantization.packing import Fields, pack_rows

Bytes = npt.NDArray[np.uint8]
# (blocks of a slab's rows) -> codes [values], scales [blocks of 32, fields' bytes], header or None
Parser = Callable[[Bytes], tuple[Bytes, Bytes, Bytes | None]]

SLAB_VALUES = 1 << 21  # values packed per slab


def _q4_0(blocks: Bytes) -> tuple[Bytes, Bytes, None]:
    codes = np.empty((blocks.shape[0], 2, 16), np.uint8)
    _nibbles_into(blocks[:, 2:], codes)
    return codes, blocks[:, 0:2], None


def _q4_1(blocks: Bytes) -> tuple[Bytes, Bytes, None]:
    codes = np.empty((blocks.shape[0], 2, 16), np.uint8)
    _nibbles_into(blocks[:, 4:], codes)
    return codes, blocks[:, 0:4], None


def _q5_0(blocks: Bytes) -> tuple[Bytes, Bytes, None]:
    return _five_bit(blocks[:, 2:6], blocks[:, 6:]), blocks[:, 0:2], None


def _q5_1(blocks: Bytes) -> tuple[Bytes, Bytes, None]:
    return _five_bit(blocks[:, 4:8], blocks[:, 8:]), blocks[:, 0:4], None


def _q8_0(blocks: Bytes) -> tuple[Bytes, Bytes, None]:
    # An int8 plus 128, as a uint8, is the same byte with its top bit flipped.
    return blocks[:, 2:] ^ np.uint8(0x80), blocks[:, 0:2], None


def _k4_scales(blocks: Bytes) -> Bytes:
    """Q4_K's and Q5_K's 6-bit scale and minimum of each block of 32: [blocks * 8, 2]."""
    scales, mins = _scale_min_k4(blocks[:, 4:16])
    return np.stack([scales, mins], axis=-1).reshape(-1, 2)


def _q4_k(blocks: Bytes) -> tuple[Bytes, Bytes, Bytes]:
    n = blocks.shape[0]
    codes = np.empty((n * 4, 2, 32), np.uint8)
    _nibbles_into(blocks[:, 16:].reshape(n * 4, 32), codes)
    return codes, _k4_scales(blocks), blocks[:, 0:4]


def _q5_k(blocks: Bytes) -> tuple[Bytes, Bytes, Bytes]:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:].reshape(n * 4, 32)).reshape(n, 8, 32)
    high = _bit_planes(blocks[:, 16:48], 1)
    return low | (high << np.uint8(4)), _k4_scales(blocks), blocks[:, 0:4]


def _q6_k(blocks: Bytes) -> tuple[Bytes, Bytes, Bytes]:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128].reshape(n * 2, 64)).reshape(n, 8, 32)
    high = _bit_planes(blocks[:, 128:192].reshape(n * 2, 32), 2).reshape(n, 8, 32)
    return low | (high << np.uint8(4)), blocks[:, 192:208].reshape(n * 8, 2), blocks[:, 208:210]


def _iq4_xs(blocks: Bytes) -> tuple[Bytes, Bytes, Bytes]:
    n = blocks.shape[0]
    codes = np.empty((n * 8, 2, 16), np.uint8)
    _nibbles_into(blocks[:, 8:].reshape(n * 8, 16), codes)
    return codes, iq4_xs_scales(blocks).view(np.uint8).reshape(n * 8, 1), blocks[:, 0:2]


PARSERS: dict[str, Parser] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "IQ4_NL": _q4_0,  # the same block: d and 32 nibbles (here indices into the levels)
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_XS": _iq4_xs,
}
NATIVE_TYPES: tuple[str, ...] = tuple(PARSERS)


def fields(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Fields:
    """Rows of a tensor of `type_name` (`raw`: the bytes of `shape`'s whole rows) as fields."""
    parser = PARSERS.get(type_name)
    if parser is None:
        raise ValueError(
            f"tensor type {type_name!r} has no packed format; those that do: {NATIVE_TYPES}"
        )
    rows, k = shape
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    expected = rows * row_nbytes(type_name, k)  # raises if a row splits a block
    if data.size != expected:
        raise ValueError(
            f"{type_name} tensor of shape {shape} needs {expected} bytes, got {data.size}"
        )
    blocks = data.reshape(-1, layout(type_name).type_size)
    codes, scales, header = parser(blocks)
    return Fields(
        FORMATS[type_name],
        np.ascontiguousarray(codes).reshape(rows, k),
        np.ascontiguousarray(scales).reshape(rows, k // BLOCK, -1),
        None
        if header is None
        else np.ascontiguousarray(header).reshape(rows, -1, header.shape[-1]),
    )


def pack_tensor(raw: np.ndarray, type_name: str, shape: tuple[int, int], out: Bytes) -> None:
    """Pack a whole tensor into `out` (FORMATS[type_name].packed_bytes(*shape) bytes), a slab of
    whole panels at a time."""
    rows, k = shape
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    slab = max(PANEL, SLAB_VALUES // max(k, 1) // PANEL * PANEL)
    for first in range(0, rows, slab):
        last = min(first + slab, rows)
        pack_rows(fields(data[first:last], type_name, (last - first, k)), out, first)
