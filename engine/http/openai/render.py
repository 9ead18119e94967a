"""POST /v1/chat/completions/render (vLLM's): what a chat completion request would run, without
running it: its prompt's token ids (rendered by the chat template in a tokenizer actor, as the
request's would be), that prompt as text, and the sampling parameters the model's defaults and
the server's limits give it. A body /v1/chat/completions would refuse is refused the same way.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.http.openai.errors import ApiError, outcome_of
from engine.http.openai.parsing import parse_chat
from engine.http.state import ServerState
from engine.messages.requests import ChatOptions
from engine.request.outputs import EngineError

ENDPOINT = "chat_render"


class RenderedChat(msgspec.Struct, kw_only=True):
    request_id: str
    model: str
    token_ids: list[int]
    prompt: str
    sampling_params: dict[str, object]


def render_routes(state: ServerState) -> list[Route]:
    async def render(request: Request) -> Response:
        try:
            return await _render(request, state)
        except ApiError as e:
            state.metrics.count_request(ENDPOINT, outcome_of(e.status))
            raise

    return [Route("/v1/chat/completions/render", render, methods=["POST"])]


async def _render(request: Request, state: ServerState) -> Response:
    if state.draining:
        raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
    state.authorize(request)
    body = await state.read_body(request)
    api = parse_chat(body, state.served_names)
    (chat,) = api.requests
    try:
        lease = await state.acquire(api.model)
    except EngineError as e:
        raise ApiError(e.status, e.message, param="model" if e.status == 404 else None) from None
    try:
        served = lease.engine
        assert served.tokens is not None and chat.messages is not None
        try:
            served.llm.policy.apply(chat)  # the defaults, the limits and the chat template
        except EngineError as e:
            raise ApiError(e.status, e.message, param=e.param) from None
        ids = await served.tokens.chat_tokens(chat.messages, chat.chat or ChatOptions())
        text = await served.tokens.text_of(ids)
    finally:
        lease.release()
    state.metrics.for_model(state.base_of(api.model)).count_request(ENDPOINT, "success")
    rendered = RenderedChat(
        request_id=api.request_id,
        model=api.model,
        token_ids=ids,
        prompt=text,
        # every field, defaults included (the struct's own encoding omits them)
        sampling_params=msgspec.to_builtins(msgspec.structs.asdict(chat.params)),
    )
    return Response(msgspec.json.encode(rendered), media_type="application/json")
