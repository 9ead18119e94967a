"""`engine serve` / `python -m engine [serve]`: load settings, then start the engine and the HTTP
server."""

from __future__ import annotations

import sys
from collections.abc import Mapping

from engine.launch.hf_cache import with_resolved_model
from engine.settings import load_settings
from engine.settings.api_key import COMMAND_LINE_WARNING


def run_serve(argv: list[str], environ: Mapping[str, str]) -> int:
    settings, sources = load_settings(argv, environ)  # invalid settings fail here, first
    if sources["server.api_key"] == "flag":
        print(COMMAND_LINE_WARNING, file=sys.stderr)
    settings = with_resolved_model(settings, environ)  # a repo id: its HF cache snapshot
    if settings.parallel.node_rank > 0:  # a host of a multi-host topology that runs ranks only
        from engine.launch.worker_node import serve_worker_node

        return serve_worker_node(settings)
    from engine.http.launcher import serve_forever

    return serve_forever(settings)
