"""`engine serve` / `python -m engine [serve]`: load settings, then start the engine and the HTTP
server."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from engine.cli.model_path import resolve_model
from engine.settings import Settings, load_settings


def run_serve(argv: list[str], environ: Mapping[str, str]) -> int:
    settings, _ = load_settings(argv, environ)  # invalid settings fail here, before any import
    settings = with_resolved_model(settings, environ)
    if settings.parallel.node_rank > 0:  # a host of a multi-host topology that runs ranks only
        from engine.worker_node import serve_worker_node

        return serve_worker_node(settings)
    from engine.http.launcher import serve_forever

    return serve_forever(settings)


def with_resolved_model(settings: Settings, environ: Mapping[str, str]) -> Settings:
    """A repo id as --model becomes its cached snapshot; clients still see the id (as vLLM)."""
    model = settings.model
    if model.path is None:
        return settings
    snapshot = resolve_model(model.path, environ)
    if snapshot is None:
        return settings
    names = model.served_name or (model.path,)
    resolved = msgspec.structs.replace(model, path=snapshot, served_name=names)
    return msgspec.structs.replace(settings, model=resolved)
