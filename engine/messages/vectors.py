"""The bytes of a pooled vector (messages/steps.PooledVector): little-endian float32, the layout
OpenAI's base64 embeddings use too, so the HTTP API sends them on unchanged."""

from __future__ import annotations

import array
import sys


def float32_bytes(values: list[float]) -> bytes:
    packed = array.array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def float32_values(data: bytes) -> list[float]:
    if len(data) % 4:
        raise ValueError(f"a float32 vector takes a multiple of 4 bytes, got {len(data)}")
    packed = array.array("f")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()
