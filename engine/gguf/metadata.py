"""The byte-level grammar of a GGUF header: scalars, strings, typed and nested arrays.

Every read is bounds-checked against the buffer, and every count is checked against the bytes
left before anything is allocated, so a damaged or hostile file fails fast with `GGUFError`
instead of allocating terabytes or reading past the end.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np


class GGUFError(ValueError):
    """A GGUF file that cannot be read: the message names the file and what is wrong with it."""


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

STRING, ARRAY = 8, 9
# Value type id -> little-endian numpy dtype, for the fixed-size types.
_SCALARS: dict[int, np.dtype[Any]] = {
    0: np.dtype("u1"),
    1: np.dtype("i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_MAX_NESTING = 8  # arrays of arrays: deeper than anything real, shallow enough for the stack


class Cursor:
    """Reads GGUF values from a buffer in order, raising `GGUFError` on a short or odd read."""

    def __init__(self, buf: mmap.mmap | bytes, size: int, path: Path) -> None:
        self.buf = buf
        self.size = size
        self.path = path
        self.pos = 0
        self.context = "the header"  # what is being read, for the error messages

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {self.context}: {problem}")

    def need(self, nbytes: int) -> None:
        if nbytes > self.size - self.pos:
            raise self.fail(
                f"truncated: needs {nbytes} bytes at offset {self.pos}, "
                f"the file has {self.size - self.pos} left"
            )

    def u32(self) -> int:
        self.need(4)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(value)

    def u64(self) -> int:
        self.need(8)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(value)

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count of items that must fit, at `min_item_bytes` each, in what is left."""
        n = self.u64()
        if n * min_item_bytes > self.size - self.pos:
            raise self.fail(
                f"claims {n} {what}, more than the {self.size - self.pos} bytes left can hold"
            )
        return n

    def string(self) -> str:
        n = self.count("string bytes", 1)
        raw = bytes(memoryview(self.buf)[self.pos : self.pos + n])
        self.pos += n
        return self._decode(raw)

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"string {raw[:40]!r} is not valid UTF-8 ({e.reason})") from None

    def value(self, type_id: int, depth: int = 0) -> Any:
        if type_id == STRING:
            return self.string()
        if type_id == ARRAY:
            return self.array(depth + 1)
        dtype = self.dtype(type_id)
        self.need(dtype.itemsize)
        item = np.frombuffer(self.buf, dtype, 1, self.pos)[0].item()
        self.pos += dtype.itemsize
        return item

    def dtype(self, type_id: int) -> np.dtype[Any]:
        dtype = _SCALARS.get(type_id)
        if dtype is None:
            known = sorted([*_SCALARS, STRING, ARRAY])
            raise self.fail(f"value type {type_id} is unknown; known types: {known}")
        return dtype

    def array(self, depth: int) -> list[Any]:
        if depth > _MAX_NESTING:
            raise self.fail(f"arrays nested deeper than {_MAX_NESTING} levels")
        item_type = self.u32()
        if item_type == STRING:
            return self._strings(self.count("strings", 8))
        if item_type == ARRAY:
            n = self.count("arrays", 12)  # each: a u32 item type and a u64 count
            return [self.array(depth + 1) for _ in range(n)]
        dtype = self.dtype(item_type)
        n = self.count("array items", dtype.itemsize)
        items = np.frombuffer(self.buf, dtype, n, self.pos)
        self.pos += n * dtype.itemsize
        return list(items.tolist())

    def _strings(self, n: int) -> list[str]:
        # The vocabulary (~50k strings) goes through here: one tight loop, locals only.
        buf, pos, size, unpack = memoryview(self.buf), self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(n):
                (length,) = unpack(buf, pos)
                end = pos + 8 + length
                if end > size:
                    break
                append(str(buf[pos + 8 : end], "utf-8"))
                pos = end
        except (struct.error, UnicodeDecodeError):
            pass
        if len(out) < n:
            self.pos = pos
            self.string()  # re-reads the bad item, raising the precise error
        self.pos = pos
        return out
