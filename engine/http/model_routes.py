"""The catalogue over HTTP: /v1/models (and llama-server's /models) lists every model, loaded
or not, with its state; llama-server's router routes `POST /models/load` and `/models/unload`
({"model": NAME}) load and unload one by hand."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.catalogue.pool import Slot
from engine.http.openai.decoding import decode_request
from engine.http.openai.errors import ApiError
from engine.http.openai.lora_routes import adapter_cards
from engine.http.openai.parsing import check_model
from engine.http.openai.protocol import ModelCard, ModelList, ModelStatus, encode
from engine.http.openai.tokens import Tokens
from engine.http.served import ServedModel
from engine.http.state import ServerState
from engine.request.outputs import EngineError
from engine.tenants.access import check_model_access

JSON = "application/json"


class ModelAction(msgspec.Struct, kw_only=True):
    model: str


class _ModelOnly(msgspec.Struct):
    model: str | None = None


_ACTION = msgspec.json.Decoder(ModelAction)
_MODEL_ONLY = msgspec.json.Decoder(_ModelOnly)


def model_routes(state: ServerState) -> list[Route]:
    async def models(request: Request) -> Response:
        tenant = state.authorize(request)
        cards = [*listed_cards(state), *adapter_cards(state)]
        cards = [card for card in cards if tenant.may_use(card.id)]  # the tenant's models
        return Response(encode(ModelList(data=cards)), media_type=JSON)

    async def load(request: Request) -> Response:
        slot = await _act(request, state, unload=False)
        return Response(encode({"success": True, "model": card_of(state, slot)}), media_type=JSON)

    async def unload(request: Request) -> Response:
        slot = await _act(request, state, unload=True)
        return Response(encode({"success": True, "model": card_of(state, slot)}), media_type=JSON)

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/models/load", load, methods=["POST"]),
        Route("/models/unload", unload, methods=["POST"]),
    ]


async def _act(request: Request, state: ServerState, *, unload: bool) -> Slot[ServedModel]:
    tenant = state.authorize(request)
    body = await state.read_body(request)
    name = decode_request(_ACTION, body).model
    try:
        check_model_access(tenant, name)  # a model the tenant may not use is not there for it
        if unload:
            return await state.models.unload(name)
        if state.draining:
            raise EngineError("the server is shutting down", 503)
        return await state.models.load(name)
    except EngineError as e:
        raise ApiError(e.status, e.message, param="model" if e.status == 404 else None) from None


def model_cards(state: ServerState) -> list[ModelCard]:
    return [card_of(state, slot) for slot in state.models.slots.values()]


def listed_cards(state: ServerState) -> list[ModelCard]:
    """/v1/models' entries: a card for every name a request may use, as vLLM lists each
    --served-model-name (a client picks its model from this list); an alias's card is its
    model's, under the alias."""
    cards = []
    for card in model_cards(state):
        cards.append(card)
        cards += [msgspec.structs.replace(card, id=alias) for alias in card.aliases or ()]
    return cards


def card_of(state: ServerState, slot: Slot[ServedModel]) -> ModelCard:
    served = slot.engine
    loaded = served is not None and slot.state == "loaded"
    expires = slot.expires_at
    return ModelCard(
        id=slot.name,
        created=state.started_at,
        max_model_len=served.max_model_len if loaded and served is not None else None,
        root=slot.entry.path,
        aliases=list(slot.entry.names[1:]) or None,
        status=ModelStatus(
            value=slot.state,
            in_flight=slot.in_flight,
            memory_bytes=slot.memory,
            loads=slot.loads,
            last_load_seconds=round(slot.last_load_seconds, 3),
            expires_in=None if expires is None else round(max(0.0, expires - time.monotonic()), 1),
            error=slot.error,
        ),
    )


@contextlib.asynccontextmanager
async def model_tokens(state: ServerState, body: bytes) -> AsyncIterator[Tokens]:
    """The tokenizer of the model a /tokenize or /detokenize body names (loaded if need be,
    held loaded while it is used)."""

    model = check_model(decode_request(_MODEL_ONLY, body).model, state.served_names)
    try:
        lease = await state.acquire(model)
    except EngineError as e:
        raise ApiError(e.status, e.message, param="model") from None
    try:
        assert lease.engine.tokens is not None
        yield lease.engine.tokens
    finally:
        lease.release()
