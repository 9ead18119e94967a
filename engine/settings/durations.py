"""Ollama's keep_alive: how long a model stays loaded after a request, as a number of seconds
or a Go-style duration ("30s", "5m", "1h30m", "-1m"). A negative duration keeps the model
loaded; 0 unloads it as soon as its requests have ended."""

from __future__ import annotations

import math
import re

FOREVER = math.inf
_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
FORM = "a duration such as 30s, 5m or 1h30m, a number of seconds, 0 or -1"


def parse_keep_alive(value: object) -> float:
    """Seconds a model stays loaded (math.inf: kept); ValueError naming the form expected."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be {FORM}, got {value!r}")
    if isinstance(value, int | float):
        return _seconds(float(value), value)
    if not isinstance(value, str):
        raise ValueError(f"keep_alive must be {FORM}, got {value!r}")
    text = value.strip()
    try:
        return _seconds(float(text), value)  # a bare number is seconds, as Ollama reads it
    except ValueError:
        pass
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    parts = _PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise ValueError(f"keep_alive must be {FORM}, got {value!r}") from None
    total = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    return _seconds(sign * total, value)


def _seconds(seconds: float, given: object) -> float:
    if math.isnan(seconds):
        raise ValueError(f"keep_alive must be {FORM}, got {given!r}")
    return FOREVER if seconds < 0 else seconds
