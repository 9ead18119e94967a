"""Settings in words: the `--help` listing and the `config show` table."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.settings.fields import FIELDS
from engine.settings.loading import ENV_ALIASES, FLAG_ALIASES, Sources
from engine.settings.schema import Settings

SECRET_KEYS = frozenset({"server.api_key"})


def settings_help() -> str:
    """Every setting: flag, aliases, expected form, default, environment variable, meaning."""
    aliases: dict[str, list[str]] = {}
    for flag, key in FLAG_ALIASES.items():
        aliases.setdefault(key, []).append(flag)
    env_aliases: dict[str, list[str]] = {}
    for var, key in ENV_ALIASES.items():
        env_aliases.setdefault(key, []).append(var)
    lines = [
        "settings (precedence: defaults < --config FILE.toml < env ENGINE_SECTION__FIELD < flags):",
        "  --config FILE      TOML file with [model], [cache], ... tables (also env ENGINE_CONFIG)",
    ]
    section = ""
    for spec in FIELDS.values():
        if spec.section != section:
            section = spec.section
            lines.append(f"\n  [{section}]")
        names = ", ".join([spec.flag, *aliases.get(spec.key, [])])
        envs = ", ".join([spec.env_var, *env_aliases.get(spec.key, [])])
        lines.append(f"  {names}")
        lines.append(f"      {spec.description}")
        lines.append(
            f"      {spec.expected()}; default {format_value(spec.key, spec.default)}; env {envs}"
        )
    return "\n".join(lines)


def format_value(key: str, value: Any) -> str:
    if value is None:
        return "none"
    if key in SECRET_KEYS:
        return "***"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value)) if value else "none"
    return str(value)


def settings_rows(settings: Settings, sources: Sources) -> list[tuple[str, str, str]]:
    """(setting, effective value, source) for every setting, secrets masked."""
    as_dict = msgspec.to_builtins(settings)
    return [
        (key, format_value(key, as_dict[spec.section][spec.name]), sources[key])
        for key, spec in FIELDS.items()
    ]


def settings_table(settings: Settings, sources: Sources, config_file: str | None = None) -> str:
    rows = [("SETTING", "VALUE", "SOURCE"), *settings_rows(settings, sources)]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    out = [f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}".rstrip() for r in rows]
    if config_file is not None:
        out.append(f"(file = {config_file})")
    return "\n".join(out)
