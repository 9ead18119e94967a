"""A LoRA adapter in PEFT's format, read and checked against the base model without torch.

An adapter directory holds `adapter_config.json` (peft_type LORA, r, lora_alpha,
target_modules, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`: A is
[r, in_features], B is [out_features, r], and a module's output gains scale * B (A x).

The root reads the config and the safetensors header (a JSON object after an 8-byte length) to
refuse, in one line, an adapter the workers could not apply; the workers load its tensors
(engine/model/lora/weights.py), checked by the same rules.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import msgspec

from engine.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by PEFT's module names.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class AdapterError(ValueError):
    """An adapter this engine cannot apply; the message names the adapter and the problem."""


class AdapterConfig(msgspec.Struct, frozen=True):
    """What the engine takes from adapter_config.json."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) for rank-stabilized LoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each targetable projection of the base model."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    inter = config.intermediate_size
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """The adapter's config, refused (AdapterError) where it asks for what is not supported."""
    file = Path(path) / CONFIG_FILE
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"LoRA adapter {path}: no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter {path}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"LoRA adapter {path}: {CONFIG_FILE} is not a JSON object")
    _refuse_unsupported(path, raw)
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"LoRA adapter {path}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {path}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"LoRA adapter {path}: lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora")), _targets(path, raw))


def _refuse_unsupported(path: str | Path, raw: dict[str, Any]) -> None:
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {path}: peft_type {raw['peft_type']!r} is not LORA")
    unsupported = {
        "use_dora": raw.get("use_dora"),
        "bias": raw.get("bias", "none") != "none",
        "modules_to_save": raw.get("modules_to_save"),
        "rank_pattern": raw.get("rank_pattern"),
        "alpha_pattern": raw.get("alpha_pattern"),
        "fan_in_fan_out": raw.get("fan_in_fan_out"),
        "layer_replication": raw.get("layer_replication"),
    }
    named = [key for key, value in unsupported.items() if value]
    if named:
        raise AdapterError(f"LoRA adapter {path}: {', '.join(named)} is not supported")


def _targets(path: str | Path, raw: dict[str, Any]) -> tuple[str, ...]:
    targets = raw.get("target_modules")
    if isinstance(targets, str):  # PEFT allows a regular expression over module names
        raise AdapterError(
            f"LoRA adapter {path}: target_modules as a pattern ({targets!r}) is not supported; "
            f"list module names among {list(SUPPORTED_MODULES)}"
        )
    if not isinstance(targets, list) or not targets:
        raise AdapterError(f"LoRA adapter {path}: target_modules must be a non-empty list")
    unknown = sorted(set(map(str, targets)) - set(SUPPORTED_MODULES))
    if unknown:
        raise AdapterError(
            f"LoRA adapter {path}: target module(s) {unknown} are not supported; "
            f"supported: {list(SUPPORTED_MODULES)}"
        )
    return tuple(sorted(map(str, targets)))


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the safetensors header alone."""
    file = Path(path) / WEIGHTS_FILE
    try:
        with file.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(length))
    except FileNotFoundError:
        raise AdapterError(f"LoRA adapter {path}: no {WEIGHTS_FILE}") from None
    except (OSError, ValueError, struct.error) as exc:
        raise AdapterError(f"LoRA adapter {path}: unreadable {WEIGHTS_FILE}: {exc}") from None
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def check_tensors(
    path: str | Path,
    adapter: AdapterConfig,
    base: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
) -> dict[tuple[int, str], tuple[str, str]]:
    """The names of each (layer, module)'s A and B tensors, every tensor's shape checked
    against the base model; AdapterError naming the first that does not fit."""
    expected = module_shapes(base)
    found: dict[tuple[int, str, str], str] = {}
    for name, shape in shapes.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise AdapterError(f"LoRA adapter {path}: tensor {name} is not a supported LoRA weight")
        layer, module, part = int(match[1]), match[2], match[3]
        if module not in adapter.target_modules or layer >= base.num_layers:
            raise AdapterError(f"LoRA adapter {path}: tensor {name} fits no base model module")
        in_features, out_features = expected[module]
        want = (adapter.rank, in_features) if part == "A" else (out_features, adapter.rank)
        if shape != want:
            raise AdapterError(
                f"LoRA adapter {path}: tensor {name} has shape {list(shape)}; the base model "
                f"needs {list(want)}"
            )
        found[layer, module, part] = name
    pairs = {}
    for layer, module, part in found:
        other = "B" if part == "A" else "A"
        if (layer, module, other) not in found:
            raise AdapterError(
                f"LoRA adapter {path}: layer {layer} {module} has lora_{part} without lora_{other}"
            )
        pairs[layer, module] = (found[layer, module, "A"], found[layer, module, "B"])
    if not pairs:
        raise AdapterError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weight")
    return pairs


def check_adapter(path: str | Path, base: ModelConfig, max_rank: int) -> AdapterConfig:
    """Everything the root can check before a worker loads the adapter."""
    adapter = read_adapter_config(path, max_rank)
    check_tensors(path, adapter, base, tensor_shapes(path))
    return adapter
