"""A quantized weight's fields (codes, per-block scales, per-chunk headers) arranged into the
packed layout of engine/quantization/layout.py, with numpy (torch-free).

Producers (engine/gguf/native_blocks.py for a GGUF file's tensors, `codes_fields` for weights
quantized at load) give the fields of a slab of whole rows; `pack_rows` writes that slab's panels
into the weight's bytes, so a large tensor is packed a few MiB at a time.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from engine.quantization.codes import BlockCodes
from engine.quantization.layout import (
    BLOCK,
    CHUNK_BLOCKS,
    CODES_FORMAT,
    GROUP,
    PANEL,
    Format,
    check_row,
    panels,
)

Bytes = npt.NDArray[np.uint8]


@dataclasses.dataclass
class Fields:
    """Rows of a weight in `format`, unpacked: codes [rows, k] (one unsigned code a value; IQ4:
    the level's index), scales [rows, k / 32, sum(scale_fields)] (each block's fields' bytes,
    little-endian) and, for formats with a header, header [rows, k / 256, sum(header_fields)]."""

    format: Format
    codes: Bytes
    scales: Bytes
    header: Bytes | None = None

    def __post_init__(self) -> None:
        rows, k = self.codes.shape
        check_row(self.format, k)
        expected = (rows, k // BLOCK, sum(self.format.scale_fields))
        if self.scales.shape != expected:
            raise ValueError(f"{self.format.name}: scales {self.scales.shape}, expected {expected}")
        if self.format.header_fields:
            header = (rows, k // (BLOCK * CHUNK_BLOCKS), sum(self.format.header_fields))
            if self.header is None or self.header.shape != header:
                got = None if self.header is None else self.header.shape
                raise ValueError(f"{self.format.name}: header {got}, expected {header}")


def codes_fields(codes: BlockCodes) -> Fields:
    """BlockCodes (float32 scales and minimums) as the fields of U4 or U8."""
    floats = np.stack([codes.scales, codes.mins], axis=-1).astype("<f4")
    rows, blocks = codes.scales.shape
    scales = np.ascontiguousarray(floats).view(np.uint8).reshape(rows, blocks, 8)
    return Fields(CODES_FORMAT[codes.bits], codes.codes, scales)


def pack_rows(fields: Fields, out: Bytes, first_row: int) -> None:
    """Write the panels of `fields` (rows first_row.., first_row a multiple of PANEL) into `out`,
    the whole weight's packed bytes."""
    fmt = fields.format
    rows, k = fields.codes.shape
    if first_row % PANEL:
        raise ValueError(f"a slab of rows starts at a panel, got row {first_row}")
    count = panels(rows)
    panel_bytes = fmt.panel_bytes(k)
    start = first_row // PANEL * panel_bytes
    target = out[start : start + count * panel_bytes].reshape(count, panel_bytes)
    padded = PANEL * count
    codes = _block_areas(fmt, _padded(fields.codes, padded))
    high = _high_planes(fmt, _padded(fields.codes, padded))
    scales = _field_areas(_padded(fields.scales, padded), fmt.scale_fields)
    header = None
    if fields.header is not None:
        header = _field_areas(_padded(fields.header, padded), fmt.header_fields)
    blocks = k // BLOCK
    offset = 0
    for first in range(0, blocks, CHUNK_BLOCKS):
        last = min(first + CHUNK_BLOCKS, blocks)
        size = fmt.chunk_bytes(last - first)
        area = target[:, offset : offset + size]
        parts = [codes[:, first:last], high[:, first:last], scales[:, first:last]]
        flat = [part.reshape(count, -1) for part in parts]
        if header is not None:
            flat.insert(0, header[:, first // CHUNK_BLOCKS].reshape(count, -1))
            flat[0] = np.pad(flat[0], ((0, 0), (0, fmt.header_bytes - flat[0].shape[1])))
        joined = np.concatenate(flat, axis=1)
        area[:, : joined.shape[1]] = joined
        area[:, joined.shape[1] :] = 0
        offset += size


def _padded(array: Bytes, rows: int) -> Bytes:
    """`array` with zero rows appended up to `rows` (a panel's unused rows)."""
    if array.shape[0] == rows:
        return array
    out = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
    out[: array.shape[0]] = array
    return out


def _grouped(codes: Bytes) -> Bytes:
    """[panels * 16, k] -> [panel, block, group, row, value in group]."""
    rows, k = codes.shape
    shaped = codes.reshape(rows // PANEL, PANEL, k // BLOCK, BLOCK // GROUP, GROUP)
    return shaped.transpose(0, 2, 3, 1, 4)


def _block_areas(fmt: Format, codes: Bytes) -> Bytes:
    """Each block's code area: [panel, block, code_bytes]."""
    grouped = _grouped(codes)
    count, blocks = grouped.shape[:2]
    if fmt.code_bits == 8:
        return np.ascontiguousarray(grouped).reshape(count, blocks, -1)
    low = grouped[:, :, :4] & np.uint8(0x0F)
    high = grouped[:, :, 4:] & np.uint8(0x0F)
    return (low | (high << np.uint8(4))).reshape(count, blocks, -1)


def _high_planes(fmt: Format, codes: Bytes) -> Bytes:
    """Each block's high-bit planes: [panel, block, high_bytes] (empty for 4 and 8 bits)."""
    grouped = _grouped(codes)
    count, blocks = grouped.shape[:2]
    extra = fmt.code_bits - 4 if fmt.code_bits != 8 else 0
    if extra == 0:
        return np.zeros((count, blocks, 0), np.uint8)
    top = (grouped >> np.uint8(4)).astype(np.uint8)  # [panel, block, group, row, value]
    per_plane = 8 // extra  # groups per plane
    planes = np.zeros((count, blocks, extra, PANEL, GROUP), np.uint8)
    for group in range(8):
        plane, slot = divmod(group, per_plane)
        planes[:, :, plane] |= top[:, :, group] << np.uint8(extra * slot)
    return planes.reshape(count, blocks, -1)


def _field_areas(values: Bytes, widths: tuple[int, ...]) -> Bytes:
    """[panels * 16, n, sum(widths)] per-row field bytes -> [panel, n, fields' areas]: field by
    field, the 16 rows' values in row order."""
    rows, n, _ = values.shape
    areas = []
    start = 0
    for width in widths:
        field = values[:, :, start : start + width].reshape(rows // PANEL, PANEL, n, width)
        areas.append(field.transpose(0, 2, 1, 3).reshape(rows // PANEL, n, PANEL * width))
        start += width
    return np.concatenate(areas, axis=2)
