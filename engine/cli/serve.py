"""`engine serve` / `python -m engine [serve]`: load settings, then start the engine and the HTTP
server."""

from __future__ import annotations

from collections.abc import Mapping

from engine.launch.hf_cache import with_resolved_model
from engine.settings import load_settings


def run_serve(argv: list[str], environ: Mapping[str, str]) -> int:
    settings, _ = load_settings(argv, environ)  # invalid settings fail here, before any import
    settings = with_resolved_model(settings, environ)  # a repo id: its HF cache snapshot
    if settings.parallel.node_rank > 0:  # a host of a multi-host topology that runs ranks only
        from engine.launch.worker_node import serve_worker_node

        return serve_worker_node(settings)
    from engine.http.launcher import serve_forever

    return serve_forever(settings)
