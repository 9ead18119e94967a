"""`python -m engine [serve]`: load settings, then start the engine and the HTTP server."""

from __future__ import annotations

from collections.abc import Mapping

from engine.settings import load_settings


def run_serve(argv: list[str], environ: Mapping[str, str]) -> int:
    settings, _ = load_settings(argv, environ)  # invalid settings fail here, before any import
    from engine.http.launcher import serve_forever

    return serve_forever(settings)
