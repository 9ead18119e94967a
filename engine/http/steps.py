"""The app's own request steps (engine/http/app.py: authorization, reading the body under its
deadline, racing a client's disconnect), handed to the routes that sit below the app: the
adapted APIs and the embeddings route use them as the OpenAI routes do."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from starlette.requests import Request

from engine.http.state import ServerState

T = TypeVar("T")


class UntilDisconnect(Protocol):
    def __call__(self, request: Request, work: Awaitable[T]) -> Awaitable[T | None]: ...


@dataclass(frozen=True)
class HttpSteps:
    check_auth: Callable[[Request, ServerState], None]
    read_body: Callable[[Request, int], Awaitable[bytes]]
    until_disconnect: UntilDisconnect
