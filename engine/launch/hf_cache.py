"""A model named by a Hugging Face repo id (`org/name`) that is no local directory: found in the
local Hugging Face cache, offline (nothing is downloaded), as vLLM finds it once downloaded."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import msgspec

from engine.settings import Settings, SettingsError

_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_hub_cache(environ: Mapping[str, str]) -> Path:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (huggingface_hub's)."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def resolve_model(model: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The checkpoint directory of a repo id from the cache; None when `model` is a path (it
    is left to the loader). A repo id absent from the cache is a SettingsError naming both."""
    if Path(model).expanduser().exists() or not _REPO_ID_RE.match(model):
        return None
    cache = hf_hub_cache(environ)
    repo_dir = cache / ("models--" + model.replace("/", "--"))
    revision = _main_revision(repo_dir)
    snapshot = repo_dir / "snapshots" / revision if revision else None
    if snapshot is None or not (snapshot / "config.json").is_file():
        raise SettingsError(
            f"model {model!r} is not a local directory nor in the Hugging Face cache {cache} "
            "(download it first, e.g. `huggingface-cli download " + model + "`)"
        )
    return str(snapshot)


def _main_revision(repo_dir: Path) -> str | None:
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        return ref.read_text().strip() or None
    snapshots = repo_dir / "snapshots"
    found = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
    return found[0] if len(found) == 1 else None  # no refs/main: only an unambiguous snapshot


def with_resolved_model(settings: Settings, environ: Mapping[str, str] = os.environ) -> Settings:
    """A repo id as the model becomes its cached snapshot; clients still see the id (as vLLM)."""
    model = settings.model
    if model.path is None:
        return settings
    snapshot = resolve_model(model.path, environ)
    if snapshot is None:
        return settings
    names = model.served_name or (model.path,)
    resolved = msgspec.structs.replace(model, path=snapshot, served_name=names)
    return msgspec.structs.replace(settings, model=resolved)
