"""The paged KV cache: one preallocated tensor, viewed per layer as a flat array of token slots.

Slot `block * block_size + offset` holds one token's K (or V) for every KV head. One extra slot
past the last block stays zero: attention gathers it wherever a padded batch has no real token,
so masked-out positions never read uninitialised memory (0 * NaN would still be NaN).
"""

from __future__ import annotations

from typing import Any

import torch


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
        """`buffer`: writable memory to hold the cache (a shared-memory segment its kv_transfer
        actor maps too, P/D), exactly `storage_bytes` long; None: allocate it."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.null_slot = self.num_slots  # the always-zero padding slot
        shape = (num_layers, 2, self.num_slots + 1, num_kv_heads, head_dim)
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

    def block_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V as [num_blocks, block_size, kv_heads, head_dim] (KV transfer)."""
        shape = (self.num_blocks, self.block_size, *self.keys[layer].shape[1:])
        return (
            self.keys[layer][: self.num_slots].view(shape),
            self.values[layer][: self.num_slots].view(shape),
        )

    def write(
        self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store the K/V [tokens, kv_heads, head_dim] of this step's tokens into their slots."""
        self.keys[layer].index_copy_(0, slot_mapping, key)
        self.values[layer].index_copy_(0, slot_mapping, value)


def storage_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()
