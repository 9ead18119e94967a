"""vLLM's routes for LoRA adapters at run time: POST /v1/load_lora_adapter {"lora_name",
"lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}, answered as vLLM answers them (a
plain-text success line; an OpenAI-style error otherwise), behind the API key when one is set.

An adapter is checked (config and tensor shapes against the base model) before it is served; the
workers load it when a request first names it (engine/lora/registry.py says why). Its path must
lie in a directory lora.lora_path_allow names (--lora-path-allow; 403 without detail otherwise),
and its files are read on a thread, bounded in size and time. Unloading an adapter that running
requests use lets them finish with it; new requests naming it get 404.
"""

from __future__ import annotations

import asyncio

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from engine.http.openai.decoding import decode_request
from engine.http.openai.errors import ApiError
from engine.http.openai.protocol import ModelCard
from engine.http.state import ServerState
from engine.lora.registry import AdapterForbidden, AdapterRegistry
from engine.request.outputs import EngineError


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None  # accepted as vLLM does; the name says which


LOAD_TIMEOUT_S = 10.0  # reading an adapter's config and header: milliseconds on a local disk
_LOAD = msgspec.json.Decoder(LoadLoRAAdapterRequest)
_UNLOAD = msgspec.json.Decoder(UnloadLoRAAdapterRequest)


def lora_routes(state: ServerState) -> list[Route]:
    async def body_of(request: Request) -> bytes:
        state.authorize(request)
        return await state.read_body(request)

    async def load(request: Request) -> Response:
        body = decode_request(_LOAD, await body_of(request))
        registry = _registry(state)
        reading = asyncio.to_thread(registry.admit, body.lora_name, body.lora_path)
        try:  # its files are read on a thread: a slow or odd file never holds the event loop
            registry.add(await asyncio.wait_for(reading, LOAD_TIMEOUT_S))
        except AdapterForbidden:
            raise ApiError(403, "lora_path is not allowed", param="lora_path") from None
        except TimeoutError:
            raise ApiError(
                400,
                f"LoRA adapter '{body.lora_name}': its files took over {LOAD_TIMEOUT_S:g} s to "
                "read",
                param="lora_path",
            ) from None
        except ValueError as exc:
            raise ApiError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(request: Request) -> Response:
        body = decode_request(_UNLOAD, await body_of(request))
        try:
            _registry(state).unload(body.lora_name)
        except KeyError as exc:
            raise ApiError(404, exc.args[0], param="lora_name", code="not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return [
        Route("/v1/load_lora_adapter", load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
    ]


def _registry(state: ServerState) -> AdapterRegistry:
    """The default model's adapters (vLLM's routes name no base model)."""
    try:
        adapters = state.primary().llm.adapters
    except EngineError as e:
        raise ApiError(e.status, e.message) from None
    if adapters is None:
        raise ApiError(400, "LoRA adapters are not enabled: start the server with --enable-lora")
    return adapters


def adapter_cards(state: ServerState) -> list[ModelCard]:
    """/v1/models' entries for the loaded models' adapters, as vLLM lists them: root = the
    adapter's path, parent = its --lora-modules base_model_name, else its model's name."""
    cards = []
    for name, served in state.models.loaded():
        adapters = served.llm.adapters
        if adapters is None:
            continue
        cards += [
            ModelCard(
                id=lora.lora_name,
                created=state.started_at,
                max_model_len=served.max_model_len,
                root=lora.lora_path,
                parent=adapters.parents.get(lora.lora_name, name),
            )
            for lora in adapters.adapters.values()
        ]
    return cards
