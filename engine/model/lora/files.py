"""A LoRA adapter in PEFT's format, read and checked against the base model without torch.

An adapter directory holds `adapter_config.json` (peft_type LORA, r, lora_alpha,
target_modules, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`: A is
[r, in_features], B is [out_features, r], and a module's output gains scale * B (A x).

The root reads the config and the safetensors header (a JSON object after an 8-byte length) to
refuse, in one line, an adapter the workers could not apply; the workers load its tensors
(engine/model/lora/weights.py), checked by the same rules.

A client may name the path (POST /v1/load_lora_adapter), so nothing here trusts the files: each
is opened without following a link and without blocking (a FIFO would otherwise hold the reader
until someone wrote to it), must be a regular file, and is read only up to a bound (the config's
size, the header's length). Errors name the adapter and the rule it broke, never a value read
from its files: those go to the log, for the operator.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from engine.model.config import ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes a few hundred bytes
MAX_HEADER_BYTES = 16 << 20  # a rank-1024 adapter of every module of 200 layers takes ~250 KiB
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


def read_adapter_config(path: str | Path, max_rank: int, label: str = "") -> AdapterConfig:
    """The adapter's config, refused (AdapterError) where it asks for what is not supported.
    `label`: what errors call the adapter (default: its path)."""
    where = f"LoRA adapter {label or path}"
    text = read_bounded(Path(path) / CONFIG_FILE, MAX_CONFIG_BYTES, where)
    try:
        raw = json.loads(text)
    except ValueError:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not valid JSON") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} is not a JSON object")
    _refuse_unsupported(where, raw)
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{where}: r must be an integer >= 1")
    if rank > max_rank:
        log.warning("%s: rank %d exceeds --max-lora-rank %d", where, rank, max_rank)
        raise AdapterError(f"{where}: its rank (r) exceeds --max-lora-rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha must be a number")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora")), _targets(where, raw))


def _refuse_unsupported(where: str, raw: dict[str, Any]) -> None:
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: its peft_type is not LORA")
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
        raise AdapterError(f"{where}: {', '.join(named)} is not supported")


def _targets(where: str, raw: dict[str, Any]) -> tuple[str, ...]:
    targets = raw.get("target_modules")
    if isinstance(targets, str):  # PEFT allows a regular expression over module names
        raise AdapterError(
            f"{where}: target_modules as a pattern is not supported; list module names among "
            f"{list(SUPPORTED_MODULES)}"
        )
    if not isinstance(targets, list) or not targets:
        raise AdapterError(f"{where}: target_modules must be a non-empty list")
    unknown = sorted(set(map(str, targets)) - set(SUPPORTED_MODULES))
    if unknown:
        log.warning("%s: unsupported target modules %s", where, unknown)
        raise AdapterError(
            f"{where}: it targets modules this engine does not support; supported: "
            f"{list(SUPPORTED_MODULES)}"
        )
    return tuple(sorted(map(str, targets)))


def tensor_shapes(path: str | Path, label: str = "") -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the safetensors header alone (read up to MAX_HEADER_BYTES)."""
    where = f"LoRA adapter {label or path}"
    with _opened(Path(path) / WEIGHTS_FILE, where) as (stream, size):
        prefix = stream.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise AdapterError(
                f"{where}: {WEIGHTS_FILE} does not start with a header length between 1 and "
                f"{MAX_HEADER_BYTES:,} bytes that fits in the file"
            )
        try:
            header = json.loads(stream.read(length))
            return {
                name: tuple(int(n) for n in entry["shape"])
                for name, entry in header.items()
                if name != "__metadata__"
            }
        except (ValueError, TypeError, KeyError, AttributeError):
            raise AdapterError(f"{where}: {WEIGHTS_FILE} has no valid safetensors header") from None


def read_bounded(file: Path, limit: int, where: str) -> bytes:
    """A regular file's bytes, at most `limit` of them (AdapterError naming the rule broken)."""
    with _opened(file, where) as (stream, size):
        if size > limit:
            raise AdapterError(f"{where}: {file.name} is over {limit:,} bytes")
        return stream.read(limit + 1)[:limit]


@contextlib.contextmanager
def _opened(file: Path, where: str) -> Iterator[tuple[BinaryIO, int]]:
    """`file` open for reading and its size: never through a link, never blocking, only a
    regular file."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AdapterError(f"{where}: no {file.name}") from None
    except OSError as exc:
        raise AdapterError(f"{where}: cannot open {file.name} ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as stream:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AdapterError(f"{where}: {file.name} is not a regular file")
        os.set_blocking(fd, True)
        yield stream, info.st_size


def check_tensors(
    path: str | Path,
    adapter: AdapterConfig,
    base: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    label: str = "",
) -> dict[tuple[int, str], tuple[str, str]]:
    """The names of each (layer, module)'s A and B tensors, every tensor's shape checked
    against the base model; AdapterError naming the first rule broken (the offending tensor
    and shapes go to the log)."""
    where = f"LoRA adapter {label or path}"
    expected = module_shapes(base)
    found: dict[tuple[int, str, str], str] = {}
    for name, shape in shapes.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            log.warning("%s: tensor %r is not a supported LoRA weight", where, name)
            raise AdapterError(f"{where}: {WEIGHTS_FILE} holds a tensor that is no LoRA weight")
        layer, module, part = int(match[1]), match[2], match[3]
        if module not in adapter.target_modules or layer >= base.num_layers:
            log.warning("%s: tensor %r fits no base model module", where, name)
            raise AdapterError(f"{where}: {WEIGHTS_FILE} holds a tensor for no base model module")
        in_features, out_features = expected[module]
        want = (adapter.rank, in_features) if part == "A" else (out_features, adapter.rank)
        if shape != want:
            log.warning("%s: tensor %s has shape %s, needs %s", where, name, list(shape), want)
            raise AdapterError(f"{where}: its tensor shapes do not fit the base model")
        found[layer, module, part] = name
    pairs = {}
    for layer, module, part in found:
        other = "B" if part == "A" else "A"
        if (layer, module, other) not in found:
            raise AdapterError(
                f"{where}: layer {layer} {module} has lora_{part} without lora_{other}"
            )
        pairs[layer, module] = (found[layer, module, "A"], found[layer, module, "B"])
    if not pairs:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weight")
    return pairs


def check_adapter(
    path: str | Path, base: ModelConfig, max_rank: int, label: str = ""
) -> AdapterConfig:
    """Everything the root can check before a worker loads the adapter; `label`: what errors
    call it (a served name; default: its path)."""
    adapter = read_adapter_config(path, max_rank, label)
    check_tensors(path, adapter, base, tensor_shapes(path, label), label)
    return adapter
