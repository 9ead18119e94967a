"""A GGUF (v2, v3, little-endian) reader: metadata parsed by hand, tensors memory-mapped.

The header is parsed eagerly (metadata and tensor infos, all validated against the file's
size), the tensor bytes lazily: `raw` is a view of the mapping and `tensor` / `rows` decode only
the bytes asked for. It does not use the `gguf` package, whose reader takes seconds on a 49k
vocabulary; that package is the reference the tests compare against.
"""

from __future__ import annotations

import dataclasses
import mmap
from math import prod
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.gguf.metadata import Cursor, GGUFError
from engine.gguf.quants import LAYOUTS, SUPPORTED_TYPES, dequantize, row_nbytes

__all__ = ["GGUFError", "GGUFFile", "TensorInfo", "read_gguf"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# ggml's type ids, supported or not, so that an unsupported tensor is named in the error.
GGML_TYPE_NAMES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # ggml's name of the tensor type: "F32", "Q4_1", "Q6_K", ...
    shape: tuple[int, ...]  # numpy order, the reverse of ggml's ne: (out_features, in_features)
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """An open GGUF file: its metadata, its tensors' infos, and their bytes on demand."""

    def __init__(
        self,
        path: Path,
        metadata: dict[str, Any],
        tensors: dict[str, TensorInfo],
        data: npt.NDArray[np.uint8],
    ) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors  # in file order
        self._data: npt.NDArray[np.uint8] | None = data

    def info(self, name: str) -> TensorInfo:
        found = self.tensors.get(name)
        if found is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return found

    def raw(self, name: str) -> npt.NDArray[np.uint8]:
        """The tensor's bytes: a read-only view of the mapping, nothing copied."""
        if self._data is None:
            raise ValueError(f"{self.path} is closed")
        info = self.info(name)
        return self._data[info.offset : info.offset + info.nbytes]

    def tensor(
        self, name: str, out: npt.NDArray[np.float32] | None = None
    ) -> npt.NDArray[np.float32]:
        """The whole tensor as float32, shaped `shape`; decoded into `out` when one is given."""
        info = self.info(name)
        return dequantize(self.raw(name), info.type_name, info.shape, out)

    def rows(
        self, name: str, start: int, stop: int, out: npt.NDArray[np.float32] | None = None
    ) -> npt.NDArray[np.float32]:
        """Rows [start, stop) along the first axis, decoding only their blocks.

        For a 1-D tensor the rows are elements, and both ends must fall on block boundaries.
        """
        info = self.info(name)
        if not 0 <= start <= stop <= info.shape[0]:
            raise IndexError(f"{name}: rows [{start}, {stop}) out of range for shape {info.shape}")
        row_len = prod(info.shape[1:])
        try:
            lo, hi = (row_nbytes(info.type_name, row * row_len) for row in (start, stop))
        except ValueError as e:
            raise ValueError(f"{self.path}: {name}: rows [{start}, {stop}): {e}") from None
        shape = (stop - start, *info.shape[1:])
        return dequantize(self.raw(name)[lo:hi], info.type_name, shape, out)

    def close(self) -> None:
        # Dropping the reference, not closing the map: arrays from `raw` may still view it, and
        # the mapping goes away with the last of them.
        self._data = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file: parse and check its header, map its bytes; tensors decode on demand."""
    path = Path(path)
    with path.open("rb") as f:
        size = f.seek(0, 2)
        if size < 24:  # magic, version, tensor count, metadata count
            raise GGUFError(f"{path}: truncated: {size} bytes, shorter than a GGUF header")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = Cursor(mapped, size, path)
    n_tensors, n_keys = _read_header(cursor)
    metadata = _read_metadata(cursor, n_keys)
    alignment = _alignment(cursor, metadata)
    infos = _read_tensor_infos(cursor, n_tensors)
    data_start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for info in infos:
        if info.name in tensors:
            cursor.context = f"tensor {info.name!r}"
            raise cursor.fail("appears twice")
        tensors[info.name] = _place(cursor, info, data_start, alignment)
    return GGUFFile(path, metadata, tensors, np.frombuffer(mapped, np.uint8))


def _read_header(cursor: Cursor) -> tuple[int, int]:
    magic = bytes(cursor.buf[:4])
    if magic != MAGIC:
        raise cursor.fail(f"not a GGUF file: starts with {magic!r}, expected {MAGIC!r}")
    cursor.pos = 4
    version = cursor.u32()
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        endian = " (a big-endian file; only little-endian is read)" if swapped in VERSIONS else ""
        raise cursor.fail(f"GGUF version {version} is not supported{endian}; supported: {VERSIONS}")
    n_tensors = cursor.count("tensors", 32)  # a name length, a dimension, a type, an offset
    n_keys = cursor.count("metadata keys", 12)  # a key length and a value type, at least
    return n_tensors, n_keys


def _read_metadata(cursor: Cursor, n_keys: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for i in range(n_keys):
        cursor.context = f"metadata entry {i}"
        key = cursor.string()
        cursor.context = f"metadata key {key!r}"
        if key in metadata:
            raise cursor.fail("appears twice")
        metadata[key] = cursor.value(cursor.u32())
    return metadata


def _alignment(cursor: Cursor, metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        cursor.context = "metadata key 'general.alignment'"
        raise cursor.fail(f"{alignment!r} is not a positive power of two")
    return alignment


def _read_tensor_infos(cursor: Cursor, n_tensors: int) -> list[TensorInfo]:
    infos: list[TensorInfo] = []
    for i in range(n_tensors):
        cursor.context = f"tensor info {i}"
        name = cursor.string()
        cursor.context = f"tensor {name!r}"
        shape = _read_shape(cursor)
        type_name = _type_name(cursor, cursor.u32())
        offset = cursor.u64()  # relative to the data section, for now
        infos.append(TensorInfo(name, type_name, shape, offset, _nbytes(cursor, type_name, shape)))
    return infos


def _read_shape(cursor: Cursor) -> tuple[int, ...]:
    n_dims = cursor.u32()
    if not 1 <= n_dims <= MAX_DIMS:
        raise cursor.fail(f"has {n_dims} dimensions; supported: 1 to {MAX_DIMS}")
    ne = [cursor.u64() for _ in range(n_dims)]
    if prod(ne) >= 1 << 62:
        raise cursor.fail(f"dimensions {ne} give more elements than any file could hold")
    return tuple(reversed(ne))


def _type_name(cursor: Cursor, type_id: int) -> str:
    name = GGML_TYPE_NAMES.get(type_id)
    if name not in LAYOUTS:
        found = f"type {name} ({type_id})" if name else f"type id {type_id}, unknown to ggml"
        raise cursor.fail(f"has {found}, which is not supported; supported: {SUPPORTED_TYPES}")
    return name


def _nbytes(cursor: Cursor, type_name: str, shape: tuple[int, ...]) -> int:
    try:
        row_bytes = row_nbytes(type_name, shape[-1])
    except ValueError as e:
        raise cursor.fail(f"shape {shape}: {e}") from None
    return row_bytes * prod(shape[:-1])


def _place(cursor: Cursor, info: TensorInfo, data_start: int, alignment: int) -> TensorInfo:
    """The info with its absolute offset, once its bytes are known to lie inside the file."""
    cursor.context = f"tensor {info.name!r}"
    if info.offset % alignment:
        raise cursor.fail(
            f"data offset {info.offset} is not a multiple of the alignment {alignment}"
        )
    offset = data_start + info.offset
    if offset + info.nbytes > cursor.size:
        raise cursor.fail(
            f"data runs past the end of the file: bytes {offset} to {offset + info.nbytes}, "
            f"the file has {cursor.size} (truncated?)"
        )
    return dataclasses.replace(info, offset=offset)
