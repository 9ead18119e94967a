"""A streamed response whose clean-up runs exactly once, however the response ends.

A StreamingResponse's body generator cleans up in its own `finally` only if it started. When the
client disconnects before the body sender's first step, Starlette cancels the sender with the
generator never entered: a `finally` inside it never runs. `release` here runs from the
response itself, after the body generator is closed, whether the stream ran to its end, broke,
or never began.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ReleasingStream(StreamingResponse):
    body_iterator: AsyncGenerator[bytes, None]

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        release: Callable[[], Awaitable[None]],
        *,
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(body, status_code, headers=headers, media_type=media_type)
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                await self.release()
