"""Settings: one schema (msgspec Structs), loaded defaults < TOML < environment < flags."""

from __future__ import annotations

from engine.settings.fields import FIELDS, FieldSpec
from engine.settings.loading import (
    ENV_ALIASES,
    FLAG_ALIASES,
    SettingsError,
    Sources,
    config_file_of,
    default_settings,
    load_settings,
    resolve_home,
)
from engine.settings.schema import (
    AdminSettings,
    CacheSettings,
    ModelSettings,
    ParallelSettings,
    RuntimeSettings,
    SchedulerSettings,
    ServerSettings,
    Settings,
)

__all__ = [
    "ENV_ALIASES",
    "FIELDS",
    "FLAG_ALIASES",
    "AdminSettings",
    "CacheSettings",
    "FieldSpec",
    "ModelSettings",
    "ParallelSettings",
    "RuntimeSettings",
    "SchedulerSettings",
    "ServerSettings",
    "Settings",
    "SettingsError",
    "Sources",
    "config_file_of",
    "default_settings",
    "load_settings",
    "resolve_home",
]
