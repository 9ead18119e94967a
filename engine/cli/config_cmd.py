"""`python -m engine config show [flags] [--json]`: effective settings and where each came from."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import msgspec

from engine.settings import FIELDS, SettingsError, config_file_of, load_settings
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
        sys.stdout.write(msgspec.json.encode(payload).decode() + "\n")
    else:
        print(settings_table(settings, sources, config_file_of(rest, environ)))
    return 0
