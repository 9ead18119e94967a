"""The chat page's routes without a server: what GET / and /ui/ serve, and --no-ui."""

from __future__ import annotations

import re
from types import SimpleNamespace

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.testclient import TestClient

from engine.http.openai.errors import ApiError
from engine.http.ui.page import chat_page_routes, read_page_files
from engine.settings import load_settings


def page_state(*flags: str) -> SimpleNamespace:
    """The part of ServerState the page's file routes read: the settings, and an API key check
    that fails the test."""
    settings, _ = load_settings(list(flags), {})
    return SimpleNamespace(settings=settings, authorize=refuse_all)


def refuse_all(request: Request) -> None:
    raise AssertionError("the page's files and /ui/info need no API key")


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return Response(exc.encoded(), status_code=exc.status, media_type="application/json")


def test_no_ui_serves_no_page() -> None:
    assert chat_page_routes(page_state("--no-ui")) == []
    assert chat_page_routes(page_state("--server.ui", "false")) == []
    assert chat_page_routes(page_state())


def test_page_and_every_file_it_loads_are_served_from_the_package() -> None:
    routes = chat_page_routes(page_state("--api-key", "k"))
    app = Starlette(routes=routes, exception_handlers={ApiError: api_error})
    with TestClient(app) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        loaded = re.findall(r'(?:src|href)="(ui/[^"]+)"', page.text)
        assert {"ui/app.js", "ui/markdown.js", "ui/style.css"} <= set(loaded)
        for path in loaded:
            response = client.get("/" + path)
            assert response.status_code == 200, path
            assert response.content == read_page_files()[path.removeprefix("ui/")][0]
        assert client.get("/ui/info").json() == {"api_key_required": True}
        missing = client.get("/ui/nothing.js")
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "no file 'nothing.js' in the chat page"


def test_no_file_fetched_from_outside() -> None:
    """Every URL in the page's files is this server's: no CDN, no font or script from elsewhere."""
    for name, (body, _) in read_page_files().items():
        text = body.decode()
        outside = re.findall(r"""(?:src|href)\s*=\s*["'](?!ui/|data:)([^"'$]+)""", text)
        assert outside == [], (name, outside)
        assert "//" not in "".join(re.findall(r"""fetch\(\s*["'`]([^"'`]*)""", text)), name
