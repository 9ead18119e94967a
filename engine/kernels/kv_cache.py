"""The paged KV cache: one preallocated tensor, viewed per layer as a flat array of token slots.

Slot `block * block_size + offset` holds one token's K (or V) for every KV head. One extra slot
past the last block stays zero: attention gathers it wherever a padded batch has no real token,
so masked-out positions never read uninitialised memory (0 * NaN would still be NaN).

A slot's head rows are in the cache's own dtype, which need not be the model's: float32,
bfloat16, float16, or int8 (`torch.int8`): `head_dim` codes followed by the row's float32 scale
(its largest magnitude / 127), written as 4 more int8 elements, so that a block's bytes carry
their scales wherever they are copied (P/D transfers, the restart segments). The compiled CPU
kernels read and write the same layout (engine/kernels/cpu/kv_rows.h) and quantize alike, bit for
bit; `write` and `gather` here are the torch versions, for the other backends.
"""

from __future__ import annotations

from typing import Any

import torch

# The cache dtypes by name (the --kv-cache-dtype values other than auto) and their row formats.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}
INT8_SCALE_ELEMENTS = 4  # the float32 scale after an int8 row's codes


def head_row_elements(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of `dtype` one head row of K (or V) takes in the cache."""
    return head_dim + INT8_SCALE_ELEMENTS if dtype == torch.int8 else head_dim


class PagedKVCache:
    """K and V for `num_blocks` blocks of `block_size` tokens in each of `num_layers` layers."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        buffer: Any = None,
    ) -> None:
        """`dtype`: the cache's (KV_CACHE_DTYPES). `buffer`: writable memory to hold the cache
        (a shared-memory segment its kv_transfer actor maps too, P/D), exactly `storage_bytes`
        long; None: allocate it."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if dtype not in KV_CACHE_DTYPES.values():
            names = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"unsupported KV cache dtype {dtype}; expected one of {names}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.num_slots = num_blocks * block_size
        self.null_slot = self.num_slots  # the always-zero padding slot
        row = head_row_elements(head_dim, dtype)
        shape = (num_layers, 2, self.num_slots + 1, num_kv_heads, row)
        if buffer is not None:
            if device.type != "cpu":
                raise ValueError(f"a KV cache in shared memory must be on the CPU, not {device}")
            raw = torch.frombuffer(buffer, dtype=torch.uint8)
            expected = storage_bytes(shape, dtype)
            if raw.numel() != expected:
                raise ValueError(f"KV cache buffer is {raw.numel()} bytes, expected {expected}")
            self.storage = raw.view(dtype).view(shape)
        else:
            # empty, not zeros: pages of a large CPU cache are only touched as blocks get used.
            self.storage = torch.empty(shape, dtype=dtype, device=device)
        self.storage[:, :, self.null_slot].zero_()
        self.keys = [self.storage[layer, 0] for layer in range(num_layers)]
        self.values = [self.storage[layer, 1] for layer in range(num_layers)]

    @property
    def quantized(self) -> bool:
        """Whether rows are int8 codes with scales (else plain elements of `dtype`)."""
        return self.dtype == torch.int8

    def block_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V as [num_blocks, block_size, kv_heads, head row] (KV transfer)."""
        shape = (self.num_blocks, self.block_size, *self.keys[layer].shape[1:])
        return (
            self.keys[layer][: self.num_slots].view(shape),
            self.values[layer][: self.num_slots].view(shape),
        )

    def write(
        self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store the K/V [tokens, kv_heads, head_dim] of this step's tokens into their slots."""
        self.keys[layer].index_copy_(0, slot_mapping, self.encode(key))
        self.values[layer].index_copy_(0, slot_mapping, self.encode(value))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Head rows [..., head_dim] in the cache's format."""
        if not self.quantized:
            return x.to(self.dtype)
        x = x.float()
        scale = x.abs().amax(-1, keepdim=True) / 127.0
        scaled = torch.where(scale > 0, x / scale, torch.zeros_like(x))
        codes = scaled.round().clamp(-127, 127).to(torch.int8)
        return torch.cat((codes, scale.contiguous().view(torch.int8)), dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Head rows of the cache [..., head row] as values [..., head_dim] of `dtype`."""
        if not self.quantized:
            return rows.to(dtype)
        codes, scale = rows[..., : self.head_dim], rows[..., self.head_dim :]
        return (codes.float() * scale.contiguous().view(torch.float32)).to(dtype)

    def gather(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots, [*slots.shape, kv_heads, head_dim] of `dtype`."""
        return (
            self.decode(self.keys[layer][slots], dtype),
            self.decode(self.values[layer][slots], dtype),
        )


def storage_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()
