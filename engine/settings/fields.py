"""What the loader knows about each setting, read once from the schema's annotations.

A `FieldSpec` can parse a value written as text (environment, flags), check a typed value (TOML)
against the schema's bounds, and say in words what it expects, so every error names the
setting, the value given and the allowed form.
"""

from __future__ import annotations

import json
import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import msgspec.inspect as mi

from engine.settings.schema import SECTIONS

Kind = Literal["int", "float", "bool", "str", "choice", "list"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"", "none", "null"}
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
# vLLM's human_readable_int: k/m/g/t = powers of 1000 (decimals allowed, "25.6k"),
# K/M/G/T = powers of 1024 (whole numbers only, "32K" = 32768).
_DECIMAL_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_HUMAN_INT_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([kmgtKMGT])$")
_BYTES_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class FieldSpec:
    section: str
    name: str
    kind: Kind
    optional: bool
    annotation: Any  # the field's full type hint, bounds included: what msgspec validates
    default: Any
    description: str
    is_bytes: bool = False
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    min_length: int | None = None
    choices: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env_var(self) -> str:
        return f"ENGINE_{self.section.upper()}__{self.name.upper()}"

    @property
    def flag(self) -> str:
        return f"--{self.key}"

    def expected(self) -> str:
        """The allowed form in words, e.g. 'an integer in [1, 1024]'."""
        if self.kind == "bool":
            text = "true or false"
        elif self.kind == "list":
            text = "a list of strings (JSON, comma-separated, or several words after the flag)"
        elif self.kind == "choice":
            text = "one of " + ", ".join(self.choices)
        elif self.kind == "str":
            text = "a non-empty string" if self.min_length else "a string"
        else:
            noun = "an integer" if self.kind == "int" else "a number"
            if self.is_bytes:
                noun = "a byte count (e.g. 1048576, 512MiB, 2GB)"
            text = noun + _range_words(self.gt, self.ge, self.lt, self.le)
        return text + (" or unset (none)" if self.optional else "")

    def parse_text(self, text: str) -> Any:
        """Turn a value written as text (env var, flag) into a checked value."""
        stripped = text.strip()
        if self.optional and (stripped == "" if self.kind == "str" else stripped.lower() in _NONE):
            return None
        value: Any
        if self.kind == "bool":
            lowered = stripped.lower()
            if lowered not in _TRUE | _FALSE:
                raise ValueError(self._complaint(text))
            value = lowered in _TRUE
        elif self.kind == "int":
            value = _parse_bytes(stripped) if self.is_bytes else _parse_int(stripped)
            if value is None:
                raise ValueError(self._complaint(text))
        elif self.kind == "float":
            try:
                value = float(stripped)
            except ValueError:
                raise ValueError(self._complaint(text)) from None
        elif self.kind == "choice":
            value = stripped.lower()
        elif self.kind == "list":
            value = _parse_list(stripped)
            if value is None:
                raise ValueError(self._complaint(text))
        else:
            value = text
        return self.check(value, shown=text)

    def check(self, value: Any, *, shown: Any = None) -> Any:
        """Validate a typed value against the schema; return it normalised (int → float)."""
        if self.is_bytes and isinstance(value, str):
            parsed = _parse_bytes(value)
            if parsed is None:
                raise ValueError(self._complaint(value))
            value = parsed
        if self.kind == "list" and isinstance(value, str):  # TOML: one name for a list of one
            value = [value]
        if self.kind == "float" and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(self._complaint(value if shown is None else shown))
        try:
            return msgspec.convert(value, self.annotation, strict=True)
        except msgspec.ValidationError:
            raise ValueError(self._complaint(value if shown is None else shown)) from None

    def _complaint(self, shown: Any) -> str:
        return f"expected {self.expected()}, got {shown!r}"


def _range_words(gt: float | None, ge: float | None, lt: float | None, le: float | None) -> str:
    low = ge if ge is not None else gt
    high = le if le is not None else lt
    if low is not None and high is not None:
        left = "[" if ge is not None else "("
        right = "]" if le is not None else ")"
        return f" in {left}{_num(low)}, {_num(high)}{right}"
    if low is not None:
        return f" {'>=' if ge is not None else '>'} {_num(low)}"
    if high is not None:
        return f" {'<=' if le is not None else '<'} {_num(high)}"
    return ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _parse_int(text: str) -> int | None:
    try:
        return int(text, 10)
    except ValueError:
        pass
    match = _HUMAN_INT_RE.match(text)
    if match is None:
        return None
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIX:
        return int(float(number) * _DECIMAL_SUFFIX[suffix])
    if "." in number:
        return None  # as vLLM: no decimals with a binary suffix ("25.6K": say 25.6k)
    return int(number) * _BINARY_SUFFIX[suffix]


def _parse_list(text: str) -> list[str] | None:
    """A JSON list of strings ('["*"]', as vLLM's flags take it) or comma-separated words; one
    JSON object is one item (vLLM's --lora-modules '{"name": ..., "path": ...}')."""
    if text.startswith("{"):
        return [text]
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return None
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def _parse_bytes(text: str) -> int | None:
    match = _BYTES_RE.match(text)
    if match is None:
        return None
    number, unit = match.groups()
    scale = _BYTE_UNITS.get(unit.lower())
    if scale is None:
        return None
    amount = float(number.replace("_", "")) * scale
    return int(amount) if amount.is_integer() else None


def _spec_for(section: str, field: mi.Field, annotation: Any) -> FieldSpec:
    info: mi.Type = field.type
    optional = False
    if isinstance(info, mi.UnionType):
        others = [t for t in info.types if not isinstance(t, mi.NoneType)]
        optional = len(others) < len(info.types)
        (info,) = others
    description = ""
    extra: dict[str, Any] = {}
    if isinstance(info, mi.Metadata):
        description = (info.extra_json_schema or {}).get("description", "")
        extra = info.extra or {}
        info = info.type
    if isinstance(info, mi.UnionType):  # Annotated[X | None, Meta(...)]
        others = [t for t in info.types if not isinstance(t, mi.NoneType)]
        optional = optional or len(others) < len(info.types)
        (info,) = others
    common: dict[str, Any] = {
        "section": section,
        "name": field.name,
        "optional": optional,
        "annotation": annotation,
        "default": field.default,
        "description": description,
        "is_bytes": extra.get("unit") == "bytes",
    }
    if isinstance(info, mi.BoolType):
        return FieldSpec(kind="bool", **common)
    if isinstance(info, mi.IntType | mi.FloatType):
        kind: Kind = "int" if isinstance(info, mi.IntType) else "float"
        return FieldSpec(kind=kind, gt=info.gt, ge=info.ge, lt=info.lt, le=info.le, **common)
    if isinstance(info, mi.LiteralType):
        return FieldSpec(kind="choice", choices=tuple(str(v) for v in info.values), **common)
    if isinstance(info, mi.StrType):
        return FieldSpec(kind="str", min_length=info.min_length, **common)
    if isinstance(info, mi.VarTupleType) and isinstance(info.item_type, mi.StrType):
        return FieldSpec(kind="list", **common)
    raise TypeError(f"settings field {section}.{field.name}: unsupported type {info!r}")


def _build_specs() -> dict[str, FieldSpec]:
    specs: dict[str, FieldSpec] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls, include_extras=True)
        struct_info = mi.type_info(cls)
        assert isinstance(struct_info, mi.StructType)
        for field in struct_info.fields:
            spec = _spec_for(section, field, hints[field.name])
            specs[spec.key] = spec
    return specs


# Every setting, keyed "section.field", in schema order.
FIELDS: dict[str, FieldSpec] = _build_specs()
