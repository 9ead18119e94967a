"""The packed formats of quantized weights, as the CPU kernel reads them (the contract with
engine/kernels/cpu/quant_formats.h; torch-free: the memory plan counts these bytes in the root,
which runs no torch).

Each GGUF block type keeps its own width; weights quantized at load use U4 and U8 (codes with a
float32 scale and minimum). A weight [rows, k] (k a multiple of 32; of 256 for the K-quants and
IQ4_XS) is cut into panels of PANEL rows (rows past the last padded with zeros) and each panel's
rows into chunks of CHUNK_BLOCKS blocks of 32 values (256: a K-quant's super-block; a row's last
chunk may have fewer). A panel's chunks follow each other; a chunk is

    header | codes of its blocks | high-bit planes of its blocks | scales of its blocks | zeros

padded to 64 bytes, where:

- header (K-quants and IQ4_XS, 64 bytes): the chunk's float16 d of the 16 rows, then their
  float16 dmin (Q4_K, Q5_K) or zeros.
- codes: each block's 16 rows x 32 unsigned codes u, in groups of 4 consecutive values (what one
  VNNI dot product sums): group g of row i is at [(g * PANEL + i) * 4, +4). With 8-bit codes
  (Q8_0, U8) a block's area is 512 bytes. Otherwise it is 256 bytes of nibbles: byte
  (g * PANEL + i) * 4 + t holds group g's value t in its low nibble and group g + 4's in its
  high nibble (one load, a mask and a shift give two groups).
- high-bit planes: Q5's fifth bit, 64 bytes a block: byte i * 4 + t holds bit 4 of group g's
  value t of row i at bit g. Q6_K's two top bits, 128 bytes: plane 0 (groups 0-3) then plane 1
  (4-7), byte i * 4 + t of a plane holding bits 4-5 of group g's value t at bits 2 (g % 4), +1.
- scales: each block's fields, field by field, each with the 16 rows' values in row order
  (SCALE_FIELDS: e.g. Q4_1's 16 float16 d, then its 16 float16 m).

A block's value is s * (u - offset) + mn (FORMATS' docs say what s and mn are per type); IQ4's
codes are indices into its 16 levels, the kernel looks the levels up.
"""

from __future__ import annotations

import dataclasses

# Bump when the packed bytes of any format change: weights repacked on disk by an older layout
# (engine/model/loading/weight_cache.py) are then not mapped.
LAYOUT_VERSION = 1
BLOCK = 32  # values per block: one scale (and one minimum)
PANEL = 16  # rows per panel: one 512-bit vector of int32 sums
GROUP = 4  # consecutive values one VNNI instruction sums per row
CHUNK_BLOCKS = 8  # blocks per chunk: 256 values
ALIGN = 64  # bytes: each chunk starts on a cache line


@dataclasses.dataclass(frozen=True)
class Format:
    """One packed format: its id in the kernel (quant_formats.h's Format) and its sizes."""

    name: str
    id: int
    code_bits: int  # 8: one byte a code; else nibbles plus (code_bits - 4) high-bit planes
    scale_fields: tuple[int, ...]  # bytes per row of each field of a block's scales
    header_fields: tuple[int, ...] = ()  # bytes per row of each field of a chunk's header
    whole_chunks: bool = False  # rows must be whole chunks (256 values)

    @property
    def code_bytes(self) -> int:
        return BLOCK * PANEL if self.code_bits == 8 else BLOCK * PANEL // 2

    @property
    def high_bytes(self) -> int:
        return 0 if self.code_bits == 8 else (self.code_bits - 4) * BLOCK * PANEL // 8

    @property
    def scale_bytes(self) -> int:
        return PANEL * sum(self.scale_fields)

    @property
    def header_bytes(self) -> int:
        return ALIGN if self.header_fields else 0

    def chunk_bytes(self, blocks: int) -> int:
        """Bytes of a chunk of `blocks` blocks (padding included)."""
        end = self.header_bytes + blocks * (self.code_bytes + self.high_bytes + self.scale_bytes)
        return -(-end // ALIGN) * ALIGN

    def panel_bytes(self, k: int) -> int:
        """Bytes of one panel of rows of k values."""
        check_row(self, k)
        full, rest = divmod(k // BLOCK, CHUNK_BLOCKS)
        return full * self.chunk_bytes(CHUNK_BLOCKS) + (self.chunk_bytes(rest) if rest else 0)

    def packed_bytes(self, rows: int, k: int) -> int:
        """Bytes of a [rows, k] weight in this format."""
        return panels(rows) * self.panel_bytes(k)


# Each format's value, s * (u - offset) + mn per block of 32 (the kernel's Traits):
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("U4", 1, 4, (4, 4)),  # s, mn float32 (a weight quantized at load)
        Format("U8", 2, 8, (4, 4)),  # s, mn float32
        Format("Q4_0", 3, 4, (2,)),  # s = d (float16), offset 8
        Format("Q4_1", 4, 4, (2, 2)),  # s = d, mn = m (float16)
        Format("Q5_0", 5, 5, (2,)),  # s = d, offset 16
        Format("Q5_1", 6, 5, (2, 2)),  # s = d, mn = m
        Format("Q8_0", 7, 8, (2,)),  # s = d, u = q + 128, offset 128
        Format("IQ4_NL", 8, 4, (2,)),  # s = d, u = the level + 128, offset 128
        # s = d * sc, mn = -(dmin * m): sc and m 6-bit integers in a byte each
        Format("Q4_K", 9, 4, (1, 1), (2, 2), True),
        Format("Q5_K", 10, 5, (1, 1), (2, 2), True),
        # s = d * sc per 16 values (two int8 per block), offset 32
        Format("Q6_K", 11, 6, (1, 1), (2,), True),
        # s = d * (ls - 32) (one int8 per block), u = the level + 128, offset 128
        Format("IQ4_XS", 12, 4, (1,), (2,), True),
    )
}
# The load-time formats by the width of BlockCodes' codes.
CODES_FORMAT = {4: FORMATS["U4"], 8: FORMATS["U8"]}


def panels(rows: int) -> int:
    return -(-rows // PANEL)


def check_row(fmt: Format, k: int) -> None:
    whole = BLOCK * CHUNK_BLOCKS if fmt.whole_chunks else BLOCK
    if k % whole:
        raise ValueError(
            f"{fmt.name}: a quantized weight's rows must be a multiple of {whole} values, got {k}"
        )


def packed_bytes(rows: int, k: int, format_name: str) -> int:
    """Bytes of a [rows, k] weight packed in the format `format_name` (FORMATS' keys)."""
    return FORMATS[format_name].packed_bytes(rows, k)
