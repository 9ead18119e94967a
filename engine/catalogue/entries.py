"""The catalogue: every model one server may serve, loaded or not, by name.

- The model named on the command line (--model, or the default model): loaded at start and
  kept, as a one-model server always was (a request's keep_alive may still unload it).
- With --models-dir DIR, every `.gguf` file directly under DIR (named by its file name without
  `.gguf`) and every directory under it holding a Hugging Face checkpoint (config.json) or one
  GGUF file (named by the directory's name), as llama-server's router and Ollama name them.
- DIR/models.toml, when present: one table per model, named by the table, e.g.

      [qwen]
      path = "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"   # relative to DIR; unset: the entry named qwen
      aliases = ["qwen2.5", "qwen:0.5b"]
      keep_alive = "10m"                          # this model's default (--keep-alive's form)
      max_model_len = 4096                        # any per-model setting, by its name...
      "scheduler.speculative_config" = '{"method": "ngram", "num_speculative_tokens": 4}'

  Settings of the sections model, cache, scheduler, limits, lora and parallel may be given by
  field name (when one section has it) or as `section.field`; each is checked as the settings
  loader checks it, and an error names the file, the table and the setting.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from engine.launch.model_source import client_name
from engine.settings import FIELDS, FieldSpec, Settings, SettingsError
from engine.settings.durations import parse_keep_alive
from engine.settings.schema import cross_field_problems

TOML_NAME = "models.toml"
PER_MODEL_SECTIONS = ("model", "cache", "scheduler", "limits", "lora", "parallel")
_ENTRY_KEYS = ("path", "aliases", "keep_alive")


@dataclasses.dataclass(frozen=True)
class CatalogueEntry:
    """One model of the catalogue: the names clients use (the first shown), the settings its
    engine starts with (the server's, with this model's path and overrides), and how long it
    stays loaded after a request by default (None: the server's --keep-alive)."""

    names: tuple[str, ...]
    settings: Settings
    origin: str  # "command line" | the models directory
    keep_alive: float | None = None
    preload: bool = False  # loaded at start (the command line's model)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def path(self) -> str:
        return self.settings.model.path or client_name(None)


def build_catalogue(settings: Settings) -> list[CatalogueEntry]:
    """The models of these settings: the command line's first, then the models directory's
    (sorted by name). A name two entries claim is refused, naming both."""
    entries = [_command_line_entry(settings)] if _serves_command_line_model(settings) else []
    if settings.models.dir is not None:
        entries += models_dir_entries(settings, Path(settings.models.dir).expanduser())
    _check_unique(entries)
    return entries


def _serves_command_line_model(settings: Settings) -> bool:
    """With a models directory, the default model is served only when named (--model)."""
    return settings.models.dir is None or settings.model.path is not None


def _command_line_entry(settings: Settings) -> CatalogueEntry:
    names = settings.model.served_name or (client_name(settings.model.path),)
    return CatalogueEntry(tuple(names), settings, "command line", preload=True)


def models_dir_entries(settings: Settings, directory: Path) -> list[CatalogueEntry]:
    if not directory.is_dir():
        raise SettingsError(f"invalid setting models.dir: {directory} is not a directory")
    found = {name: path for name, path in _scan(directory)}
    tables = _read_toml(directory / TOML_NAME)
    entries = []
    for name in sorted(set(found) | set(tables)):
        table = tables.get(name, {})
        where = f"{directory / TOML_NAME} [{name}]"
        path = _entry_path(directory, name, table, found, where)
        entries.append(_entry(settings, name, path, table, where, str(directory)))
    return entries


def _scan(directory: Path) -> list[tuple[str, Path]]:
    """(name, path) of every model directly under `directory`."""
    models = []
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.suffix == ".gguf" and not _is_later_split(path):
            models.append((path.stem, path))
        elif path.is_dir() and (
            (path / "config.json").is_file() or len(list(path.glob("*.gguf"))) == 1
        ):
            models.append((path.name, path))
    return models


def _is_later_split(path: Path) -> bool:
    """The 2nd.. parts of a split GGUF file (name-00002-of-00003.gguf) are not models."""
    stem = path.stem
    return "-of-" in stem and not stem.rsplit("-of-", 1)[0].endswith("-00001")


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SettingsError(f"cannot read {path}: {e}") from None
    for name, table in data.items():
        if not isinstance(table, dict):
            raise SettingsError(f"{path}: '{name}' must be a table ([{name}]) of its settings")
    return data


def _entry_path(
    directory: Path, name: str, table: Mapping[str, Any], found: Mapping[str, Path], where: str
) -> Path:
    given = table.get("path")
    if given is None:
        if name not in found:
            raise SettingsError(f"{where}: no model named {name!r} in {directory}; give its path")
        return found[name]
    if not isinstance(given, str):
        raise SettingsError(f"{where}: path must be a string, got {given!r}")
    path = (directory / given).expanduser()
    if not path.exists():
        raise SettingsError(f"{where}: path {given!r}: no such file or directory")
    return path


def _entry(
    settings: Settings,
    name: str,
    path: Path,
    table: Mapping[str, Any],
    where: str,
    origin: str,
) -> CatalogueEntry:
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise SettingsError(f"{where}: aliases must be a list of names, got {aliases!r}")
    keep_alive = None
    if "keep_alive" in table:
        try:
            keep_alive = parse_keep_alive(table["keep_alive"])
        except ValueError as e:
            raise SettingsError(f"{where}: {e}") from None
    overrides = {k: v for k, v in table.items() if k not in _ENTRY_KEYS}
    own = with_overrides(settings, overrides, where)
    own = replace_section(own, "model", path=str(path), served_name=())
    return CatalogueEntry((name, *aliases), own, origin, keep_alive)


def with_overrides(settings: Settings, overrides: Mapping[str, Any], where: str) -> Settings:
    """`settings` with per-model `overrides` (setting name or section.field -> value) applied,
    each checked against the schema."""
    by_section: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        spec = _per_model_field(key, where)
        try:
            by_section.setdefault(spec.section, {})[spec.name] = spec.check(value)
        except ValueError as e:
            raise SettingsError(f"{where}: invalid setting {spec.key}: {e}") from None
    for section, fields in by_section.items():
        settings = replace_section(settings, section, **fields)
    for key, problem in cross_field_problems(settings):
        raise SettingsError(f"{where}: invalid setting {key}: {problem}")
    return settings


def replace_section(settings: Settings, section: str, **fields: Any) -> Settings:
    changed = msgspec.structs.replace(getattr(settings, section), **fields)
    return msgspec.structs.replace(settings, **{section: changed})


def _per_model_field(key: str, where: str) -> FieldSpec:
    if "." in key:
        spec = FIELDS.get(key)
        candidates = [spec] if spec is not None else []
    else:
        candidates = [s for s in FIELDS.values() if s.name == key]
    candidates = [s for s in candidates if s.section in PER_MODEL_SECTIONS]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        named = ", ".join(s.key for s in candidates)
        raise SettingsError(f"{where}: {key!r} is ambiguous; write one of {named}")
    raise SettingsError(
        f"{where}: {key!r} is not a per-model setting (path, aliases, keep_alive, or a "
        f"setting of the sections {', '.join(PER_MODEL_SECTIONS)})"
    )


def _check_unique(entries: list[CatalogueEntry]) -> None:
    owner: dict[str, CatalogueEntry] = {}
    for entry in entries:
        for name in entry.names:
            first = owner.setdefault(name, entry)
            if first is not entry:
                raise SettingsError(
                    f"model name {name!r} is claimed twice: by {first.path} ({first.origin}) "
                    f"and by {entry.path} ({entry.origin})"
                )
