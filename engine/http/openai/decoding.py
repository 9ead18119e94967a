"""Request bodies → typed request structs; every way a body can be malformed → a 400 naming the
field, never the decoder's internals.

A body is JSON in UTF-8 (RFC 8259), checked strictly once before msgspec sees it: msgspec skips
unknown fields without looking at their bytes, and a bad byte inside a known string escapes it as
a UnicodeDecodeError rather than a DecodeError. Nesting is bounded by msgspec, which raises
RecursionError at the interpreter's recursion limit; integers are bounded in protocol.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from engine.http.openai.errors import ApiError

T = TypeVar("T")

_PATH_RE = re.compile(r"at `\$\.?(?P<path>[^`]*)`")
_MISSING_RE = re.compile(r"missing required field `(?P<field>[^`]+)`")
_INT_BOUND_RE = re.compile(r"^Expected `int` [<>]= -?\d+$")
_PATH_STEP_RE = re.compile(r"\[\d+\]|[^.\[\]]+")
# What the field finder reads of a body: an object key (a string before ':'), any other string
# (matched whole, so brackets inside strings do not count) or a bracket.
_TOKEN_RE = re.compile(rb'("(?:[^"\\]|\\.)*")\s*:|"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
# The field finder runs only on a failed body; past this many tokens it gives up (param null)
# rather than hold the event loop on a hostile multi-megabyte body.
_MAX_SCANNED_TOKENS = 1 << 16
# Deeper than this, a field is the one that made msgspec give up (its limit is ~1,000 levels
# minus the stack already in use; no OpenAI request field nests beyond a few dozen).
_DEEP = 256


def decode_request(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        field = _field_at(body, e.start)
        where = f" in '{field}'" if field else ""
        raise ApiError(
            400, f"request body is not valid UTF-8: byte {e.start}{where}", param=field
        ) from None
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise _from_validation_error(e, decoder.type) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        field = _deep_field(body)
        where = f"'{field}' nests" if field else "the request body nests"
        raise ApiError(
            400, f"{where} arrays or objects too deeply to be read", param=field
        ) from None


def _from_validation_error(error: msgspec.ValidationError, root: Any) -> ApiError:
    """msgspec's "Expected `int` <= 2147483647 - at `$.max_tokens`" → a 400 naming the field
    and what it takes."""
    text = str(error)
    missing = _MISSING_RE.search(text)
    path_match = _PATH_RE.search(text)
    path = path_match.group("path") if path_match else ""
    if missing:
        field = missing.group("field")
        param = f"{path}.{field}" if path else field
        return ApiError(400, f"missing required field '{param}'", param=param)
    detail = _PATH_RE.sub("", text).rstrip(" -")
    if not path:
        return ApiError(400, f"invalid request body: {detail}")
    bounds = _int_range(root, path) if _INT_BOUND_RE.match(detail) else None
    if bounds is not None:
        detail = "must be an integer " + bounds
    return ApiError(400, f"invalid value for '{path}': {detail}", param=path)


def _int_range(root: Any, path: str) -> str | None:
    """`in [lo, hi]`, `>= lo` or `<= hi`: the bounds protocol.py sets on the integer at `path`."""
    node: mi.Type | None = mi.type_info(root)
    for step in _PATH_STEP_RE.findall(path):
        node = _child(node, step)
    bounds = _member(node, mi.IntType)
    if not isinstance(bounds, mi.IntType):
        return None
    if bounds.ge is not None and bounds.le is not None:
        return f"in [{bounds.ge}, {bounds.le}]"
    return f">= {bounds.ge}" if bounds.ge is not None else f"<= {bounds.le}"


def _child(node: mi.Type | None, step: str) -> mi.Type | None:
    if step.startswith("["):
        items = _member(node, mi.ListType)
        return items.item_type if isinstance(items, mi.ListType) else None
    struct = _member(node, mi.StructType)
    if not isinstance(struct, mi.StructType):
        return None
    return next((f.type for f in struct.fields if f.encode_name == step), None)


def _member(node: mi.Type | None, kind: type[mi.Type]) -> mi.Type | None:
    """`node` itself, or its union member, of `kind`."""
    if isinstance(node, mi.UnionType):
        return next((t for t in node.types if isinstance(t, kind)), None)
    return node if isinstance(node, kind) else None


# ---------------------------------------------------------------- naming the field of a bad body


def _field_at(body: bytes, offset: int) -> str | None:
    """The top-level field whose value holds byte `offset`."""
    field = None
    for start, _, current in _scan(body):
        if start > offset:
            return field
        field = current
    return None  # the scan gave up before `offset`, or the body ends inside the bad value


def _deep_field(body: bytes) -> str | None:
    """The first top-level field nested deeper than _DEEP."""
    return next((field for _, depth, field in _scan(body) if depth > _DEEP), None)


def _scan(body: bytes) -> Iterator[tuple[int, int, str | None]]:
    """(offset, nesting depth, enclosing top-level field) at each token of `body`."""
    depth = 0
    field: str | None = None
    for count, match in enumerate(_TOKEN_RE.finditer(body)):
        if count >= _MAX_SCANNED_TOKENS:
            return
        token = match.group()
        key = match.group(1)
        if key is not None:
            if depth == 1:
                field = key[1:-1].decode("utf-8", errors="replace")
        elif token in (b"[", b"{"):
            depth += 1
        elif token in (b"]", b"}"):
            depth -= 1
        yield match.start(), depth, field
