"""A GGUF file's tensors under their Hugging Face names, read the way the loader reads a
safetensors file (`keys`, `get_tensor`, `get_slice(...)[rows]`, `[:, columns]`), dequantized to
float32 as they are read.

llama.cpp's converter permutes the rows of q and k for the `llama` architecture only (its rotary
code pairs dimension i with i+1 of each head, where Hugging Face's pairs i with i+head_dim/2);
reading undoes that, head by head, so a tensor-parallel rank's head-aligned rows come out right.
A MoE file's stacked experts (`ffn_gate_exps` [experts, rows, columns]) read as one tensor per
expert under its Hugging Face name (engine/gguf/names.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from engine.gguf.hf_config import architecture_of
from engine.gguf.metadata import GGUFError
from engine.gguf.names import EXPERT, hf_name
from engine.gguf.reader import GGUFFile


class GGUFTensors:
    """The tensors of an open GGUF file by Hugging Face name (what `safe_open` gives)."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf
        arch = architecture_of(gguf)
        self._names: dict[str, str] = {}
        self._experts: dict[str, tuple[str, int]] = {}  # an expert's name: (stacked tensor, index)
        for name in gguf.tensors:
            hf = hf_name(name, arch)
            if hf is not None and EXPERT in hf:
                for expert in range(gguf.info(name).shape[0]):
                    self._experts[hf.replace(EXPERT, str(expert))] = (name, expert)
            elif hf is not None:
                self._names[hf] = name
        self._permuted_heads: dict[str, int] = {}  # tensors whose rows are permuted: head counts
        if arch == "llama":
            heads = int(gguf.metadata["llama.attention.head_count"])
            kv_heads = int(gguf.metadata.get("llama.attention.head_count_kv") or heads)
            self._permuted_heads = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads}

    def keys(self) -> list[str]:
        return [*self._names, *self._experts]

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]

    def get_slice(self, name: str) -> _LazyTensor:
        if name not in self._names and name not in self._experts:
            raise KeyError(f"{self.gguf.path}: no tensor for {name!r}")
        return _LazyTensor(self, name)

    def rows(self, name: str, start: int, stop: int) -> npt.NDArray[np.float32]:
        """Rows [start, stop) as the Hugging Face checkpoint would hold them."""
        if name in self._experts:
            stacked, expert = self._experts[name]
            return self.gguf.rows(stacked, expert, expert + 1)[0, start:stop]
        gguf_name = self._names[name]
        heads = self._row_permutation_heads(name)
        if not heads:
            return self.gguf.rows(gguf_name, start, stop)
        # Whole heads are read and un-permuted, then cut to the rows asked for.
        rows = self.gguf.info(gguf_name).shape[0]
        head_dim = rows // heads
        first, last = start // head_dim * head_dim, -(-stop // head_dim) * head_dim
        block = _unpermute(self.gguf.rows(gguf_name, first, last), (last - first) // head_dim)
        return block[start - first : stop - first]

    def raw_rows(self, name: str) -> tuple[str, npt.NDArray[np.uint8]]:
        """The whole tensor's type and bytes, [rows, bytes per row], in the Hugging Face row
        order (each row's blocks are whole, so rows move as bytes)."""
        if name in self._experts:
            stacked, expert = self._experts[name]
            info = self.gguf.info(stacked)
            raw = np.asarray(self.gguf.raw(stacked)).view(np.uint8).reshape(info.shape[0], -1)
            return info.type_name, raw[expert].reshape(info.shape[1], -1)
        info = self.gguf.info(self._names[name])
        rows = info.shape[0]
        raw = np.asarray(self.gguf.raw(info.name)).view(np.uint8).reshape(rows, -1)
        heads = self._row_permutation_heads(name)
        return info.type_name, _unpermute(raw, heads) if heads else raw

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._experts:
            return self.gguf.info(self._experts[name][0]).shape[1:]
        return self.gguf.info(self._names[name]).shape

    def _row_permutation_heads(self, name: str) -> int:
        return next((n for part, n in self._permuted_heads.items() if f".{part}." in name), 0)


class _LazyTensor:
    """`get_slice`'s answer: the shape, and the rows or columns asked for."""

    def __init__(self, tensors: GGUFTensors, name: str) -> None:
        self._tensors = tensors
        self._name = name

    def get_shape(self) -> list[int]:
        return list(self._tensors.shape(self._name))

    def __getitem__(self, index: Any) -> torch.Tensor:
        shape = self._tensors.shape(self._name)
        rows, columns = (index, slice(None)) if not isinstance(index, tuple) else index
        if not isinstance(rows, slice) or not isinstance(columns, slice):
            raise TypeError(f"{self._name}: only slices are supported, got {index!r}")
        start, stop, step = rows.indices(shape[0])
        if step != 1:
            raise TypeError(f"{self._name}: a row step is not supported")
        array = self._tensors.rows(self._name, start, stop)
        if columns != slice(None):
            array = array[:, columns]
        return torch.from_numpy(np.ascontiguousarray(array))


def _unpermute(rows: npt.NDArray[Any], heads: int) -> npt.NDArray[Any]:
    """Undo llama.cpp's `permute`: in each head, rows (2i, 2i+1) go back to (i, i+half)."""
    if heads == 0 or rows.shape[0] % (2 * heads):
        raise GGUFError(f"cannot un-permute {rows.shape[0]} rows into {heads} heads")
    shape = rows.shape
    half = shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
