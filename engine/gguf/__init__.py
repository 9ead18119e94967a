"""GGUF files: a reader of our own and a vectorized dequantizer (no `gguf` package at run time)."""

from __future__ import annotations

from engine.gguf.metadata import GGUFError
from engine.gguf.quants import SUPPORTED_TYPES, dequantize, row_nbytes
from engine.gguf.reader import GGUFFile, TensorInfo, read_gguf

__all__ = [
    "SUPPORTED_TYPES",
    "GGUFError",
    "GGUFFile",
    "TensorInfo",
    "dequantize",
    "read_gguf",
    "row_nbytes",
]
