"""`python -m engine config show [flags] [--json]`: effective settings and where each came from."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import msgspec

from engine.launch.hf_cache import with_resolved_model
from engine.request.defaults import load_generation_defaults
from engine.settings import FIELDS, Settings, SettingsError, config_file_of, load_settings
from engine.settings.describe import SECRET_KEYS, settings_help, settings_table


def run_config(argv: list[str], environ: Mapping[str, str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m engine config show [flags] [--json]\n")
        print(settings_help())
        return 0 if argv else 2
    if argv[0] != "show":
        raise SettingsError(f"unknown config command {argv[0]!r}; expected: show")
    rest = [a for a in argv[1:] if a != "--json"]
    as_json = len(rest) != len(argv) - 1
    settings, sources = load_settings(rest, environ)
    settings = with_resolved_model(settings, environ)
    defaults = _generation_defaults(settings)
    if as_json:
        values = msgspec.to_builtins(settings)
        payload = {
            key: {
                "value": "***" if key in SECRET_KEYS and value is not None else value,
                "source": sources[key],
            }
            for key, spec in FIELDS.items()
            for value in [values[spec.section][spec.name]]
        }
        payload["generation_defaults"] = {"value": defaults, "source": "model"}
        sys.stdout.write(msgspec.json.encode(payload).decode() + "\n")
    else:
        print(settings_table(settings, sources, config_file_of(rest, environ)))
        shown = ", ".join(f"{k}={v}" for k, v in defaults.items()) or "none"
        print(f"sampling defaults (model.generation_config): {shown}")
    return 0


def _generation_defaults(settings: Settings) -> dict[str, Any]:
    """What the server will apply: read from the model's (or the named) generation_config."""
    if settings.model.path is None and settings.model.generation_config == "auto":
        return {}  # the built-in demo model has none
    try:
        return load_generation_defaults(settings.model.generation_config, settings.model.path or "")
    except ValueError as e:
        raise SettingsError(str(e)) from None
