"""LoRA adapters on a worker: their tensors laid out for the decoder's fused projections, a
bounded cache of loaded adapters, and one step's rows grouped by adapter.

The decoder fuses q|k|v and gate|up into one matmul each (engine/model/architectures/layers.py).
An adapter's parts for one fused projection become one pair: A stacks the parts' A matrices
along the rank, and B places each part's (scale * B) in its output rows and its rank columns,
zeros elsewhere. So the rows of one adapter gain (x A^T) B^T with two matmuls per projection,
whatever parts it targets: [tokens, in] x [in, parts * r] x [parts * r, out].
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import torch
from safetensors import safe_open

from engine.messages.params import LoRARequest
from engine.model.config import ModelConfig
from engine.model.lora.files import (
    WEIGHTS_FILE,
    check_tensors,
    module_shapes,
    read_adapter_config,
    tensor_shapes,
)

# Each fused projection of the decoder, and the checkpoint modules it holds, in output order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclasses.dataclass(frozen=True)
class LoraPair:
    """One fused projection's update: y += (x @ a_t) @ b_t."""

    a_t: torch.Tensor  # [in, parts * r]
    b_t: torch.Tensor  # [parts * r, out], the scale folded in


@dataclasses.dataclass(frozen=True)
class LoadedAdapter:
    name: str
    rank: int
    layers: list[dict[str, LoraPair]]  # per layer: fused projection -> its update


def load_adapter(
    request: LoRARequest,
    base: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoadedAdapter:
    path = request.lora_path
    adapter = read_adapter_config(path, max_rank)
    pairs = check_tensors(path, adapter, base, tensor_shapes(path))
    shapes = module_shapes(base)
    layers: list[dict[str, LoraPair]] = [{} for _ in range(base.num_layers)]
    with safe_open(f"{path}/{WEIGHTS_FILE}", framework="pt") as tensors:
        for layer, fused in enumerate(layers):
            for key, parts in FUSED_MODULES.items():
                present = [
                    (index, part) for index, part in enumerate(parts) if (layer, part) in pairs
                ]
                if not present:
                    continue
                r = adapter.rank
                in_features = shapes[parts[0]][0]
                out_sizes = [shapes[part][1] for part in parts]
                a_t = torch.zeros(in_features, r * len(present))
                b_t = torch.zeros(r * len(present), sum(out_sizes))
                for column, (index, part) in enumerate(present):
                    a_name, b_name = pairs[layer, part]
                    ranks = slice(column * r, (column + 1) * r)
                    out_start = sum(out_sizes[:index])
                    outputs = slice(out_start, out_start + out_sizes[index])
                    a_t[:, ranks] = tensors.get_tensor(a_name).float().T
                    b_t[ranks, outputs] = adapter.scale * tensors.get_tensor(b_name).float().T
                fused[key] = LoraPair(
                    a_t.to(device=device, dtype=dtype), b_t.to(device=device, dtype=dtype)
                )
    return LoadedAdapter(request.lora_name, adapter.rank, layers)


class AdapterCache:
    """Adapters loaded on first use, the least recently used dropped beyond `capacity`.

    Keyed by name and path: an adapter unloaded and loaded again under its name from another
    path is another adapter."""

    def __init__(
        self,
        base: ModelConfig,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int,
    ) -> None:
        self.base, self.max_rank = base, max_rank
        self.dtype, self.device = dtype, device
        self.capacity = capacity
        self.loaded: OrderedDict[tuple[str, str], LoadedAdapter] = OrderedDict()

    def get(self, request: LoRARequest) -> LoadedAdapter:
        key = (request.lora_name, request.lora_path)
        adapter = self.loaded.get(key)
        if adapter is None:
            adapter = load_adapter(request, self.base, self.max_rank, self.dtype, self.device)
            self.loaded[key] = adapter
            while len(self.loaded) > self.capacity:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(key)
        return adapter


# Steps of at most this many rows run their LoRA matmuls on one thread: they are so small
# ([rows, in] x [in, r]) that waking the other threads costs more than they save.
ONE_THREAD_ROWS = 64


# A slice of consecutive rows, or the rows' indices where they are scattered.
Rows = slice | torch.Tensor


@dataclasses.dataclass(frozen=True)
class LoraStep:
    """One step's token rows grouped by adapter: each adapter's rows run its matmuls once,
    as a slice when they are consecutive, gathered and scattered back by index otherwise."""

    groups: list[tuple[Rows, LoadedAdapter]]
    one_thread: bool = False  # run the matmuls on one thread (ONE_THREAD_ROWS)

    @classmethod
    def of(
        cls,
        row_counts: Sequence[int],
        adapters: Sequence[LoadedAdapter | None],
        device: torch.device | None = None,
    ) -> LoraStep | None:
        """From each chunk's row count and adapter (None: the base model); None when no row
        has an adapter."""
        ranges: dict[int, list[range]] = {}
        by_id: dict[int, LoadedAdapter] = {}
        start = 0
        for count, adapter in zip(row_counts, adapters, strict=True):
            if adapter is not None:
                spans = ranges.setdefault(id(adapter), [])
                by_id[id(adapter)] = adapter
                if spans and spans[-1].stop == start:
                    spans[-1] = range(spans[-1].start, start + count)
                else:
                    spans.append(range(start, start + count))
            start += count
        if not ranges:
            return None
        groups: list[tuple[Rows, LoadedAdapter]] = []
        for key, spans in ranges.items():
            if len(spans) == 1:
                groups.append((slice(spans[0].start, spans[0].stop), by_id[key]))
            else:
                rows = [row for span in spans for row in span]
                groups.append((torch.tensor(rows, dtype=torch.long, device=device), by_id[key]))
        return cls(groups, start <= ONE_THREAD_ROWS)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        """y[rows] += (x[rows] A^T) B^T for each adapter's rows, in place."""
        threads = torch.get_num_threads()
        if self.one_thread and threads > 1 and x.device.type == "cpu":
            torch.set_num_threads(1)
        try:
            for rows, adapter in self.groups:
                pair = adapter.layers[layer].get(projection)
                if pair is None:
                    continue
                if isinstance(rows, slice):
                    y[rows].addmm_(x[rows] @ pair.a_t, pair.b_t)
                else:
                    y.index_add_(0, rows, (x.index_select(0, rows) @ pair.a_t) @ pair.b_t)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
