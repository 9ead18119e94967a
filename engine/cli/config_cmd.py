"""`python -m engine config show [flags] [--json]`: effective settings and where each came from."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from engine.gguf.checkpoint import gguf_file_of
from engine.gguf.hf_config import generation_config
from engine.gguf.reader import read_gguf
from engine.launch.hf_cache import with_resolved_model
from engine.launch.model_source import DEMO_MODEL, ModelNotFound, default_model_file
from engine.request.defaults import SamplingDefaults, load_sampling_defaults
from engine.request.policy import describe_defaults
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
    defaults = _sampling_defaults(settings)
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
        payload["generation_defaults"] = {"value": defaults.values, "source": defaults.origin}
        sys.stdout.write(msgspec.json.encode(payload).decode() + "\n")
    else:
        print(settings_table(settings, sources, config_file_of(rest, environ)))
        print(f"sampling defaults: {describe_defaults(defaults, settings.limits)}")
    return 0


def _sampling_defaults(settings: Settings) -> SamplingDefaults:
    """What the server will apply: read from the model's (or the named) generation_config, or a
    GGUF file's metadata, as the server reads them."""
    model = settings.model
    try:
        return load_sampling_defaults(
            model.generation_config,
            model.path or "",
            model.override_generation_config,
            _gguf_generation_config(model.path),
        )
    except (ValueError, ModelNotFound) as e:
        raise SettingsError(str(e)) from None


def _gguf_generation_config(path: str | None) -> dict[str, Any] | None:
    """A GGUF model's generation config from its metadata (None: not a GGUF model)."""
    if path == DEMO_MODEL:
        return {}  # random weights, no file: nothing of its own
    gguf = default_model_file() if path is None else gguf_file_of(Path(path).expanduser())
    return None if gguf is None else generation_config(read_gguf(gguf))
