"""The compiled CPU backend's quantized weights, packed once into the formats of
engine/quantization/layout.py (a GGUF file's block types at their own widths, or BlockCodes of
weights quantized at load), and the C++ kernel that reads them (quantized_linear.cpp): x @ w^T +
bias with the activations quantized to int8 per block of 32, and the float32 rows of a quantized
embedding table.

A weight is one or more parts stacked by rows, each in its own format (a fused q|k|v whose v is
Q6_K and q, k Q4_K keeps each part's type); one kernel call runs all the parts.

The kernel has three paths (AVX512-VNNI, AVX2, a scalar reference), picked at run time by what the
CPU supports; all give the same bits, and a row's result does not depend on the other rows of its
batch nor on the thread count. Its error against a float matmul of the dequantized weight is that
of rounding each activation to its block's int8 step (amax / 127): the tests bound it.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from engine.kernels.cpu.build import load_library
from engine.quantization import layout
from engine.quantization.codes import BlockCodes
from engine.quantization.packing import codes_fields, pack_rows

# The kernel's `path` argument: 0 picks the fastest this CPU runs.
PATHS = {"scalar": 1, "avx2": 2, "avx512-vnni": 3}
ALIGNMENT = 64  # bytes: each chunk in whole cache lines, one vector load a group


class CPart(ctypes.Structure):
    """quantized_linear.cpp's Part."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("column", ctypes.c_int64),
        ("format", ctypes.c_int64),
    ]


@dataclasses.dataclass(frozen=True)
class PackedPart:
    """[rows, k] of a weight in one format: `data` holds its packed bytes, 64-byte aligned."""

    format: str  # a key of layout.FORMATS
    rows: int
    k: int
    data: torch.Tensor  # uint8, CPU
    source: str  # what it came from, for logs: "Q4_K", "q8_0 (from float32)", ...

    def __post_init__(self) -> None:
        expected = layout.packed_bytes(self.rows, self.k, self.format)
        if self.data.dtype != torch.uint8 or self.data.numel() != expected:
            raise ValueError(
                f"{self.source}: {self.data.numel()} bytes of {self.data.dtype} for a "
                f"[{self.rows}, {self.k}] weight in {self.format} ({expected} bytes)"
            )
        if not self.data.is_contiguous() or self.data.data_ptr() % ALIGNMENT:
            raise ValueError(f"{self.source}: packed data not contiguous and 64-byte aligned")


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [rows, k] weight: its parts stacked by rows (one, unless fused from parts of different
    formats)."""

    parts: tuple[PackedPart, ...]
    _c_parts: ctypes.Array[CPart] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.parts or len({part.k for part in self.parts}) != 1:
            raise ValueError(f"a packed weight needs parts of one row length, got {self.parts}")
        columns = np.cumsum([0] + [part.rows for part in self.parts])
        c_parts = (CPart * len(self.parts))(
            *(
                CPart(part.data.data_ptr(), part.rows, int(column), layout.FORMATS[part.format].id)
                for part, column in zip(self.parts, columns, strict=False)
            )
        )
        object.__setattr__(self, "_c_parts", c_parts)

    @property
    def rows(self) -> int:
        return sum(part.rows for part in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def nbytes(self) -> int:
        return sum(part.data.numel() for part in self.parts)

    @property
    def source(self) -> str:
        return "+".join(sorted({part.source for part in self.parts}))

    @property
    def c_parts(self) -> ctypes.Array[CPart]:
        """The parts as the kernel takes them (points into the parts' data, which this keeps)."""
        return self._c_parts


def pack(codes: BlockCodes) -> PackedWeight:
    """Codes quantized at load (float32 scales and minimums) in U4 or U8."""
    fields = codes_fields(codes)
    rows, k = codes.shape
    data = aligned_bytes(layout.packed_bytes(rows, k, fields.format.name))
    pack_rows(fields, data.numpy(), 0)
    return PackedWeight((PackedPart(fields.format.name, rows, k, data, codes.source),))


def pack_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> PackedPart:
    """A GGUF tensor's bytes (`shape` = rows, k) in its own type's format."""
    from engine.gguf.native_blocks import pack_tensor

    rows, k = shape
    data = aligned_bytes(layout.packed_bytes(rows, k, type_name))
    pack_tensor(raw, type_name, shape, data.numpy())
    return PackedPart(type_name, rows, k, data, type_name)


def stacked(parts: Sequence[PackedPart]) -> PackedWeight:
    """Parts in row order as one weight (a fused projection)."""
    return PackedWeight(tuple(parts))


def quantized_linear(
    x: torch.Tensor,
    weight: PackedWeight,
    bias: torch.Tensor | None = None,
    path: int = 0,
    threads: int | None = None,
) -> torch.Tensor:
    """x [m, k] @ w^T + bias -> float32 [m, rows], on `threads` threads (None: torch's count).
    `path`: 0 the fastest this CPU runs, else PATHS' (RuntimeError where this CPU cannot run
    it)."""
    rows, k = weight.rows, weight.k
    usable = (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[1] == k
        and x.stride(1) == 1
    )
    if not usable:
        raise ValueError(
            f"quantized_linear takes float32 CPU x [m, {k}] with adjacent elements in a "
            f"row, got {x.dtype} {x.device.type} {tuple(x.shape)} strides {x.stride()}"
        )
    if bias is not None and not (
        bias.dtype == torch.float32
        and bias.device.type == "cpu"
        and bias.shape == (rows,)
        and bias.is_contiguous()
    ):
        raise ValueError(
            f"quantized_linear takes a contiguous float32 CPU bias [{rows}], got "
            f"{bias.dtype} {bias.device.type} {tuple(bias.shape)}"
        )
    out = x.new_empty(x.shape[0], rows)
    status = load_library().engine_quantized_linear(
        x.data_ptr(),
        x.shape[0],
        k,
        x.stride(0),
        weight.c_parts,
        len(weight.parts),
        rows,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads() if threads is None else threads,
        path,
    )
    if status == 2:
        raise RuntimeError(f"the quantized linear kernel's path {path} does not run on this CPU")
    if status != 0:
        raise RuntimeError(f"the quantized linear kernel failed (status {status})")
    return out


def embedding_rows(weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight in float32, [*ids.shape, k]: gguf.quants.dequantize's values (for
    load-time codes, BlockCodes.dequantize's)."""
    if len(weight.parts) != 1:
        raise ValueError(f"an embedding table is one part, got {len(weight.parts)}")
    flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    out = torch.empty(flat.numel(), weight.k)
    status = load_library().engine_quantized_rows(
        weight.c_parts, weight.k, flat.data_ptr(), flat.numel(), out.data_ptr()
    )
    if status == 3:
        low, high = int(flat.min()), int(flat.max())
        raise IndexError(f"row ids {low}..{high}: outside [0, {weight.rows})")
    if status != 0:
        raise RuntimeError(f"the quantized rows kernel failed (status {status})")
    return out.view(*ids.shape, weight.k)


def available_paths() -> list[str]:
    """The kernel's paths this CPU runs, slowest first (the scalar reference is always there)."""
    mask = load_library().engine_quantized_paths()
    return [name for name, code in PATHS.items() if mask & (1 << code)]


def kernel_bytes(format_name: str, rows: int, k: int) -> int:
    """The kernel's own count of a part's bytes (what layout.packed_bytes must agree with)."""
    return int(load_library().engine_quantized_bytes(layout.FORMATS[format_name].id, rows, k))


def aligned_bytes(size: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `size` bytes whose first byte is 64-byte aligned (a view
    into a slightly larger one: torch's CPU allocator aligns to 64 today, but does not promise)."""
    spare = torch.empty(size + ALIGNMENT, dtype=torch.uint8)
    start = -spare.data_ptr() % ALIGNMENT
    return spare[start : start + size]
