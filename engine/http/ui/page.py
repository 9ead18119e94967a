"""The chat page: GET / and its static files under /ui/, plus the two JSON routes it reads.

The files ship inside the package (engine/http/ui/static/) and are read once when the app is
built, so the page needs no build step and nothing from outside at run time; its
Content-Security-Policy keeps the browser to this server alone. `server.ui = false` (--no-ui)
leaves only the API.

- GET /ui/info: whether an API key is needed (no key needed to ask: the page must know whether
  to ask for one before it can send it).
- GET /ui/state: the live panel's figures (actors, restarts, requests in flight, KV usage),
  behind the API key as the API is; the admin socket is a Unix socket a browser cannot reach.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.http.model_routes import model_cards
from engine.http.openai.errors import ApiError
from engine.http.openai.protocol import ModelCard
from engine.http.served import pool_health
from engine.http.state import ServerState
from engine.messages.admin import ActorRow

_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# Everything the page loads comes from this server; inline scripts and styles are refused, so a
# model's answer rendered into the page cannot run code even if the renderer let markup through.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def read_page_files() -> dict[str, tuple[bytes, str]]:
    """The page's files by name: their bytes and content type."""
    found: dict[str, tuple[bytes, str]] = {}
    for entry in files("engine.http.ui").joinpath("static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in _CONTENT_TYPES:
            found[entry.name] = (entry.read_bytes(), _CONTENT_TYPES[suffix])
    return found


def chat_page_routes(state: ServerState) -> list[Route]:
    """The page's routes, or none when the settings turn the page off."""
    if not state.settings.server.ui:
        return []
    page_files = read_page_files()

    def serve(name: str) -> Response:
        if name not in page_files:
            raise ApiError(404, f"no file {name!r} in the chat page", code="not_found")
        body, content_type = page_files[name]
        return Response(body, media_type=content_type, headers=_PAGE_HEADERS)

    async def index(request: Request) -> Response:
        return serve("index.html")

    async def asset(request: Request) -> Response:
        return serve(request.path_params["name"])

    async def info(request: Request) -> Response:
        body = {"api_key_required": bool(state.settings.server.api_key) or state.tenants.enabled}
        return _json(body)

    async def live_state(request: Request) -> Response:
        state.authorize(request)
        return _json(live_figures(state))

    return [
        Route("/", index, methods=["GET"]),
        Route("/ui/info", info, methods=["GET"]),
        Route("/ui/state", live_state, methods=["GET"]),
        Route("/ui/{name:str}", asset, methods=["GET"]),
    ]


def live_figures(state: ServerState) -> dict[str, Any]:
    """What the live panel shows: the server's health; the loaded models' load summed (KV use:
    the default model's); every loaded model's actors; and each model's state, memory and
    actors (`models`), for the page's model picker."""
    health = pool_health(state.models)
    loaded = state.models.loaded()
    figures = [(name, served.llm.stats(), served.llm.actors()) for name, served in loaded]
    several = len(state.models.slots) > 1
    main = next((stats for name, stats, _ in figures if name == state.model_name), None)
    return {
        "model": state.model_name,
        "ready": health.ready,
        "not_ready": health.not_ready,
        "failure": health.reason,
        "draining": state.draining,
        "in_flight": sum(stats.in_flight for _, stats, _ in figures),
        "running": sum(stats.num_running for _, stats, _ in figures),
        "waiting": sum(stats.num_waiting for _, stats, _ in figures),
        "kv_usage": main.kv_usage if main is not None else 0.0,
        "kv_cache_blocks": main.kv_cache_blocks if main is not None else 0,
        "resubmitted_requests": sum(stats.resubmitted_requests for _, stats, _ in figures),
        "restarts": sum(sum(stats.restarts.values()) for _, stats, _ in figures),
        "actors": [
            _actor(row, f"{name}/" if several else "") for name, _, rows in figures for row in rows
        ],
        "models": [_model(state, card) for card in model_cards(state)],
    }


def _actor(row: ActorRow, prefix: str = "") -> dict[str, Any]:
    return {
        "name": prefix + row.name,
        "state": row.state,
        "pid": row.pid,
        "restarts": row.restarts,
    }


def _model(state: ServerState, card: ModelCard) -> dict[str, Any]:
    """One model as the picker shows it: its names, state, memory and actors."""
    slot = state.models.slots[card.id]
    status = card.status
    actors = slot.engine.llm.actors() if slot.engine is not None and slot.state == "loaded" else []
    return {
        "name": card.id,
        "aliases": card.aliases or [],
        "state": status.value if status is not None else "unloaded",
        "memory_bytes": slot.memory,
        "in_flight": slot.in_flight,
        "last_load_seconds": slot.last_load_seconds,
        "error": slot.error,
        "actors": [_actor(row) for row in actors],
    }


def _json(body: Any) -> Response:
    headers = {"Cache-Control": "no-store"}
    return Response(msgspec.json.encode(body), media_type="application/json", headers=headers)
