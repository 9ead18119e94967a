"""Test facilities the engine's own processes must be able to load (spawned actors cannot
import from tests/); nothing here is active unless a test turns it on, through the hooks the
processes install from their environment (engine/runtime/hooks.py)."""

from __future__ import annotations

from collections.abc import Mapping

from engine.runtime.hooks import HOOKS_ENV


def combined(*environments: Mapping[str, str]) -> dict[str, str]:
    """Several faults' environments at once: every one's hook module is installed."""
    out: dict[str, str] = {}
    hooks: list[str] = []
    for environment in environments:
        out.update(environment)
        hooks += [name for name in environment.get(HOOKS_ENV, "").split(",") if name]
    if hooks:
        out[HOOKS_ENV] = ",".join(dict.fromkeys(hooks))
    return out
