"""The packed layout of a quantized weight, as the CPU kernel reads it (torch-free: the memory
plan counts these bytes in the root, which runs no torch).

A weight w [rows, k] (k a multiple of 32) is stored as unsigned integer codes u with a float32
scale s and minimum m per block of 32 consecutive values of a row: w[r, j] = s[r, b] * u[r, j] +
m[r, b], b = j // 32. Codes have 4 bits (0-15) or 8 bits (0-255): every GGUF block type maps
onto one of the two (Q4_0, Q4_1, Q4_K onto 4 bits; Q5_0, Q5_1, Q5_K, Q8_0 and Q6_K onto 8).

Rows are grouped in panels of PANEL (rows past the last padded with zero codes, scales and
minimums). A panel's blocks follow each other, one record per (panel, block):

    record = codes of the block's 16 rows x 32 values | 16 float32 scales | 16 float32 minimums

so a kernel streams one panel's records in order and holds them in registers for every row of
activations. Inside the codes, values go in groups of 4 consecutive k (what one VNNI dot
product sums): group g of row i is bytes [(g * PANEL + i) * 4, +4) of the group area. With 8-bit
codes the area is 8 groups x 16 rows x 4 bytes = 512 bytes. With 4-bit codes it is 256 bytes:
byte (g * PANEL + i) * 4 + t, g < 4, holds group g's value t in its low nibble and group g + 4's
in its high nibble (one load, a mask and a shift give two groups).
"""

from __future__ import annotations

BLOCK = 32  # values per block: one scale and one minimum
PANEL = 16  # rows per panel: one 512-bit vector of int32 sums
GROUP = 4  # consecutive values one VNNI instruction sums per row
CODE_BYTES = {4: BLOCK * PANEL // 2, 8: BLOCK * PANEL}  # per record
SCALE_BYTES = 2 * PANEL * 4  # 16 float32 scales, then 16 float32 minimums
RECORD_BYTES = {bits: codes + SCALE_BYTES for bits, codes in CODE_BYTES.items()}


def panels(rows: int) -> int:
    return -(-rows // PANEL)


def packed_bytes(rows: int, k: int, bits: int) -> int:
    """Bytes of a [rows, k] weight packed with `bits`-bit codes."""
    if k % BLOCK:
        raise ValueError(f"a quantized weight's rows must be a multiple of {BLOCK} values, got {k}")
    return panels(rows) * (k // BLOCK) * RECORD_BYTES[bits]
